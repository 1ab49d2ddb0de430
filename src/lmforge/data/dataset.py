"""What every ``data.kind`` is to the loader: a ``Dataset``, a never-ending stream of
samples addressed by index, and the helpers its samples are built with.

A dataset of any kind (stdlib and text corpora, pretraining ``.bin/.idx``, blends, SFT;
and preference pairs next) gives:

* ``len(ds)``: how many samples the data holds (windows, records, pairs);
* ``ds.distinct_samples``: how many the stream gives, from index 0, before one repeats
  (an epoch; what a held-out pass may score at most);
* ``ds[k]`` for every ``k >= 0``: sample ``k`` of the stream (index ``k`` past an epoch
  reads the next one, in its own order), a pure function of (data, parameters, seed, k);
* ``ds.batch(ks)``: samples ``ks`` as one batch dict of tensors. The collate is the
  dataset's, so a sample need not be one sequence (a preference pair is two);
* ``ds.fingerprint()``: sizes a resumed run checks its data against;
* ``state_dict()`` / ``load_state_dict()``: what exact resume needs beyond the position
  (empty for every kind so far, whose samples are functions of the index) and
  ``group_size``: samples per optimizer step the stream's order depends on (0: none).

A training batch holds ``input_ids`` and ``labels`` (``IGNORE_INDEX`` where a position has
no target), with document boundaries as ``positions`` and each position's document id,
``segments`` (which the model turns into a block-causal mask), when packed or
document-masked, and ``sample_ids``, the rows' stream indices.
"""
from __future__ import annotations

from typing import Iterable, Protocol, Sequence, runtime_checkable

import numpy as np
import torch

from lmforge import IGNORE_INDEX


@runtime_checkable
class Dataset(Protocol):
    group_size: int

    def __len__(self) -> int: ...

    @property
    def distinct_samples(self) -> int: ...

    def __getitem__(self, k: int): ...

    def batch(self, ks: list[int]) -> dict: ...

    def fingerprint(self) -> list: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class RowDataset:
    """The defaults of a dataset whose sample is one row dict (``make_row``/``sft_row``):
    batches are the rows stacked, and the stream has no state beyond its position."""

    group_size = 0

    def batch(self, ks: list[int]) -> dict:
        return collate([self[k] for k in ks], ks)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


# ------------------------------------------------------------------------------ rows

def make_row(pieces: Sequence[np.ndarray], seq_len: int, document_mask: bool = False,
             pad_id: int = 0) -> dict:
    """One training row from consecutive token pieces (at most ``seq_len + 1`` tokens).

    Returns numpy ``input_ids`` and ``labels`` (seq_len,), and with ``document_mask``
    ``positions`` and ``segments`` (a segment id per position; ``collate`` turns it into
    a block-causal mask). Missing tokens at the end are padding: label -100, a segment of
    their own.
    """
    tokens = np.concatenate([np.asarray(p, dtype=np.int64) for p in pieces]) if pieces \
        else np.empty(0, dtype=np.int64)
    n = len(tokens)
    if n > seq_len + 1:
        raise ValueError(f"{n} tokens do not fit a row of seq_len + 1 = {seq_len + 1}")
    input_ids = np.full(seq_len, pad_id, dtype=np.int64)
    labels = np.full(seq_len, IGNORE_INDEX, dtype=np.int64)
    real = min(n, seq_len)  # positions holding a real token
    input_ids[:real] = tokens[:real]
    labels[:max(n - 1, 0)] = tokens[1:n]  # a short row's last token has no target
    row = {"input_ids": input_ids, "labels": labels}
    if not document_mask:
        return row
    lengths = np.array([len(p) for p in pieces if len(p)], dtype=np.int64)
    seg = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)  # per token
    segments = np.full(seq_len, len(lengths), dtype=np.int64)  # padding: its own segment
    segments[:real] = seg[:real]
    # A target belongs to the document of its input; one from the next document is dropped.
    if n > 1:
        crossing = np.zeros(seq_len, dtype=bool)
        crossing[:n - 1] = seg[1:n] != seg[:n - 1]
        labels[crossing] = IGNORE_INDEX
    row["positions"] = positions_from_segments(segments)
    row["segments"] = segments
    return row


def positions_from_segments(segments: np.ndarray) -> np.ndarray:
    """0, 1, 2, ... restarting wherever the segment id changes."""
    n = len(segments)
    starts = np.flatnonzero(np.r_[True, segments[1:] != segments[:-1]])
    run_lengths = np.diff(np.r_[starts, n])
    return np.arange(n, dtype=np.int64) - np.repeat(starts, run_lengths)


def collate(rows: list[dict], sample_ids: Iterable[int]) -> dict:
    """Row dicts of numpy arrays -> the batch dict of tensors."""
    batch = {"input_ids": torch.from_numpy(np.stack([r["input_ids"] for r in rows])),
             "labels": torch.from_numpy(np.stack([r["labels"] for r in rows]))}
    if "segments" in rows[0]:
        batch["positions"] = torch.from_numpy(np.stack([r["positions"] for r in rows]))
        # the documents, which the model's attention keeps apart (models/attention.py)
        batch["segments"] = torch.from_numpy(np.stack([r["segments"] for r in rows]))
    batch["sample_ids"] = torch.tensor(list(sample_ids), dtype=torch.long)
    return batch


# ------------------------------------------------------------------- order, holdout

def rng_for(seed: int, epoch: int, purpose: int) -> np.random.Generator:
    return np.random.default_rng([seed, epoch, purpose])


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a fixed, well-spread hash of each uint64 (wrapping)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def held_out_documents(n_documents: int, eval_fraction: float) -> np.ndarray:
    """The sorted indices of the documents (or SFT records) held out for evaluation:
    ``eval_fraction`` of them (rounded, at least one), those whose index hashes lowest.
    Empty when ``eval_fraction`` is 0 or holding out would leave none to train on."""
    k = max(1, round(n_documents * eval_fraction))
    if eval_fraction <= 0 or k >= n_documents:
        return np.empty(0, dtype=np.int64)
    keys = _mix(np.arange(n_documents, dtype=np.uint64) + np.uint64(1))
    return np.sort(np.argpartition(keys, k - 1)[:k]).astype(np.int64)


def split_documents(n_documents: int, eval_fraction: float, part: str) -> np.ndarray:
    """The documents of ``part``: "train" (all but the held-out ones) or "eval"."""
    held = held_out_documents(n_documents, eval_fraction)
    if part == "eval":
        return held
    if part != "train":
        raise ValueError(f"part: {part!r} is not train or eval")
    keep = np.ones(n_documents, dtype=bool)
    keep[held] = False
    return np.flatnonzero(keep)
