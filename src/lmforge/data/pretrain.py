"""Packed pretraining samples over Megatron indexed datasets.

One epoch is one pass over every document. Epoch ``e`` orders the documents by a
permutation drawn from ``(seed, e)``, concatenates them (their EOD tokens, when written by
``preprocess --append-eod``, separate them), and cuts the stream into windows of
``seq_len + 1`` tokens, window ``j`` starting at token ``j * seq_len`` (so consecutive
windows share one token and every token but the first is a target once). The tokens left
over at the end of an epoch (fewer than ``seq_len``) are dropped. The windows of an epoch
are then visited in a second permutation drawn from ``(seed, e)``. Global sample ``k`` is
position ``k % N`` of epoch ``k // N``: the stream never ends and is a pure function of
``(data, seq_len, seed)``.

Window starts are found with a binary search over the documents' cumulative lengths
(Megatron's "sample index"); that index and the two permutations are cached as ``.npy``
files under the data cache directory (``lmforge.data.cache``: ``$LMFORGE_CACHE``, by
default ``~/.cache/lmforge``), keyed by the parameters and by a hash of the ``.idx`` file
(the document lengths), so a change to either builds a new index. Every rank builds and
writes the same bytes under a temporary name and renames it, so ranks need no
coordination and a node-local disk works.

With ``holdout = (part, eval_fraction)`` the stream covers only the training documents
(``part="train"``) or only the held-out ones (``"eval"``): ``held_out_documents`` picks
``eval_fraction`` of the documents by a fixed hash of their index, so every run on the
same data (whatever its seed) holds out the same ones.

With ``document_mask`` a window carries a segment id per position: positions restart at
0 at each document start (the first piece restarts at 0 too), attention stays inside a
document (a block-causal mask, built by the loader), and the target that would cross
from one document into the next is ignored (-100). The window's loss and gradients are
then exactly those of its document pieces run separately, weighted by their tokens.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from lmforge.data.cache import (RecentCache, cache_dir_for, content_fingerprint, keyed_dir,
                                load_or_build)
from lmforge.data.dataset import RowDataset, make_row, rng_for, split_documents
from lmforge.data.errors import DataError
from lmforge.data.indexed import IndexedDataset
from lmforge.data.indexed_files import idx_path, strip_suffix

INDEX_VERSION = 1


# ---------------------------------------------------------------------------- dataset

class PretrainDataset(RowDataset):
    """The never-ending sample stream of one indexed dataset; ``ds[k]`` is a row dict."""

    _DOCS, _SAMPLES = 1, 2  # rng purposes

    def __init__(self, prefix: str | Path, seq_len: int, seed: int = 0,
                 document_mask: bool = False, pad_id: int = 0,
                 cache_dir: Optional[Path] = None,
                 holdout: Optional[tuple[str, float]] = None):
        self.prefix = strip_suffix(prefix)
        self.data = IndexedDataset(self.prefix)
        self.seq_len, self.seed = int(seq_len), int(seed)
        self.document_mask, self.pad_id = document_mask, int(pad_id)
        self.documents = self._documents(holdout)  # None: all of them
        self._lengths = (self.data.sequence_lengths if self.documents is None
                         else self.data.sequence_lengths[self.documents])
        self._num_tokens = (self.data.num_tokens if self.documents is None
                            else int(self._lengths.sum(dtype=np.int64)))
        total = self._num_tokens
        self.samples_per_epoch = (total - 1) // self.seq_len if total else 0
        if self.samples_per_epoch < 1:
            which = f" ({holdout[0]} documents)" if holdout else ""
            raise DataError(f"{self.prefix}{which}: {total} tokens, fewer than one window "
                            f"of seq_len + 1 = {self.seq_len + 1}")
        params = {"kind": "pretrain", "version": INDEX_VERSION, "seq_len": self.seq_len,
                  "seed": self.seed}
        if holdout:
            params["holdout"] = [holdout[0], float(holdout[1])]
        # The index depends on the documents' lengths alone, all in the .idx file.
        root = cache_dir_for(self.prefix, "pretrain-index", cache_dir)
        self.cache = keyed_dir(root, params, content_fingerprint(idx_path(self.prefix)))
        self._epochs = RecentCache(2)

    def _documents(self, holdout: Optional[tuple[str, float]]) -> Optional[np.ndarray]:
        if not holdout:
            return None
        part, fraction = holdout
        n = self.data.num_sequences
        documents = split_documents(n, fraction, part)
        if len(documents) in (0, n):  # nothing held out
            raise DataError(f"{self.prefix}: too few documents ({n}) to hold out "
                            f"data.eval_fraction={fraction} of them and train on the rest")
        return documents

    @property
    def lengths(self) -> np.ndarray:
        """Document lengths: one document per sequence, as in Megatron's GPTDataset
        (only this part's documents under a holdout)."""
        return self._lengths

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def __len__(self) -> int:
        return self.samples_per_epoch

    @property
    def distinct_samples(self) -> int:
        """Windows the stream gives before one repeats: an epoch's."""
        return self.samples_per_epoch

    def fingerprint(self) -> list:
        held = self.data.num_documents if self.documents is None else len(self.documents)
        return [self.samples_per_epoch, held]

    def _document(self, position: int) -> int:
        """The dataset's sequence index of this part's document ``position``."""
        return position if self.documents is None else int(self.documents[position])

    # -- the per-epoch index
    def epoch_index(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(document order, window start locations (N, 2): [position in order, offset],
        window visiting order) of ``epoch``."""
        return self._epochs.get(epoch, lambda: self._build_epoch_index(epoch))

    def _build_epoch_index(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        order = load_or_build(self.cache / f"epoch-{epoch:06d}-docs.npy",
                              lambda: self._doc_order(epoch))
        starts = load_or_build(self.cache / f"epoch-{epoch:06d}-starts.npy",
                               lambda: self._window_starts(order))
        visit = load_or_build(self.cache / f"epoch-{epoch:06d}-visit.npy",
                              lambda: self._visit_order(epoch))
        return order, starts, visit

    def _doc_order(self, epoch: int) -> np.ndarray:
        n = len(self.lengths)
        dtype = np.int32 if n < 2 ** 31 else np.int64
        return rng_for(self.seed, epoch, self._DOCS).permutation(n).astype(dtype)

    def _window_starts(self, order: np.ndarray) -> np.ndarray:
        cum = np.zeros(len(order) + 1, dtype=np.int64)
        np.cumsum(self.lengths[order], out=cum[1:])
        starts = np.arange(self.samples_per_epoch, dtype=np.int64) * self.seq_len
        doc = np.searchsorted(cum, starts, side="right") - 1  # skips empty documents
        return np.stack([doc, starts - cum[doc]], axis=1)

    def _visit_order(self, epoch: int) -> np.ndarray:
        return rng_for(self.seed, epoch, self._SAMPLES).permutation(self.samples_per_epoch)

    # -- samples
    def window_pieces(self, epoch: int, window: int) -> list[np.ndarray]:
        """The document pieces that make up window ``window`` of ``epoch``."""
        order, starts, _ = self.epoch_index(epoch)
        pos, offset = int(starts[window, 0]), int(starts[window, 1])
        need, pieces = self.seq_len + 1, []
        while need > 0 and pos < len(order):
            doc = self.data[self._document(int(order[pos]))]
            piece = doc[offset:offset + need]
            if len(piece):
                pieces.append(piece)
                need -= len(piece)
            pos, offset = pos + 1, 0
        return pieces

    def locate(self, k: int) -> tuple[int, int]:
        """Global sample ``k`` -> (epoch, window)."""
        epoch, position = divmod(int(k), self.samples_per_epoch)
        return epoch, int(self.epoch_index(epoch)[2][position])

    def __getitem__(self, k: int) -> dict:
        epoch, window = self.locate(k)
        return make_row(self.window_pieces(epoch, window), self.seq_len,
                        self.document_mask, self.pad_id)


class BlendedDataset(RowDataset):
    """Several sample streams mixed by weight, deterministically.

    The stream is cut into blocks of ``block`` samples. After ``b`` blocks dataset ``d``
    has given exactly its largest-remainder share of ``w_d * b * block`` samples, and
    inside a block its samples are spread evenly; so any ``k`` is found from its block
    alone (no walk from the start) and the mix is exact to within one sample per block.
    """

    def __init__(self, datasets: list, weights: Sequence[float], block: int = 4096):
        w = np.asarray(weights, dtype=np.float64)
        if len(datasets) != len(w) or not len(w) or (w <= 0).any() or \
                not np.isfinite(w).all():
            raise DataError("data.blend: weights must be positive numbers, one per dataset")
        self.datasets, self.weights = datasets, w / w.sum()
        self.block = max(int(block), math.ceil(1 / self.weights.min()))
        self._blocks = RecentCache(4)

    def fingerprint(self) -> list:
        return [x for d in self.datasets for x in d.fingerprint()]

    def __len__(self) -> int:
        return sum(len(d) for d in self.datasets)

    @property
    def distinct_samples(self) -> int:
        """Samples the blend gives before any of its datasets repeats one."""
        limits = np.array([d.distinct_samples for d in self.datasets])
        b = max(int((limits / (self.weights * self.block)).min()) - 1, 0)  # just below
        while (self._taken(b + 1) <= limits).all():  # whole blocks first
            b += 1
        which, local = self._block(b)
        past = np.flatnonzero(local >= limits[which])
        return b * self.block + int(past[0])  # (a block that crosses has such a sample)

    def _taken(self, blocks: int) -> np.ndarray:
        """Samples given by each dataset after ``blocks`` blocks."""
        exact = self.weights * (blocks * self.block)
        taken = np.floor(exact).astype(np.int64)
        short = blocks * self.block - int(taken.sum())
        taken[np.argsort(-(exact - taken), kind="stable")[:short]] += 1
        return taken

    def _block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        return self._blocks.get(b, lambda: self._build_block(b))

    def _build_block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        first, last = self._taken(b), self._taken(b + 1)
        counts = last - first
        which = np.repeat(np.arange(len(counts)), counts)
        rank = np.concatenate([np.arange(n) for n in counts])
        times = (rank + 0.5) / np.repeat(np.maximum(counts, 1), counts)
        order = np.lexsort((which, times))
        return which[order], (first[which] + rank)[order]

    def source(self, k: int) -> tuple[int, int]:
        """Global sample ``k`` -> (dataset, its own sample index)."""
        b, i = divmod(int(k), self.block)
        which, local = self._block(b)
        return int(which[i]), int(local[i])

    def __getitem__(self, k: int) -> dict:
        d, local = self.source(k)
        return self.datasets[d][local]
