"""Windows over documents laid end to end: the ``Dataset`` of the in-memory text corpora
(``data.kind`` stdlib and text, training and held out) and of ``lmforge eval``'s files.

Window ``w`` holds tokens ``[w * seq_len, (w + 1) * seq_len + 1)`` of the concatenated
documents, so consecutive windows share one token and every token but the first is a
target once. ``partial_last`` keeps the last, shorter window (padded; evaluation scores
every token), else only whole windows count.

With a ``seed`` (training) the stream shuffles the windows each epoch: epoch ``e`` visits
``default_rng([seed, e]).permutation(len(self))``, cut to a multiple of
``epoch_multiple`` (the samples all ranks take per micro-step), so an epoch ends on a
micro-step. Without one the windows come in order, epoch after epoch.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from lmforge.data.cache import RecentCache
from lmforge.data.dataset import RowDataset, make_row
from lmforge.data.indexed import IndexedDataset


class TokenWindows(RowDataset):
    """``documents``: token arrays (one: a corpus already joined with its EOD tokens) or
    an ``IndexedDataset`` (its documents, read from the memory map as needed)."""

    def __init__(self, documents: Sequence[np.ndarray] | IndexedDataset, seq_len: int,
                 seed: Optional[int] = None, epoch_multiple: int = 1,
                 partial_last: bool = False, document_mask: bool = False, pad_id: int = 0):
        self.documents, self.seq_len = documents, int(seq_len)
        self.seed, self.document_mask, self.pad_id = seed, document_mask, int(pad_id)
        self._ends = np.cumsum(_document_lengths(documents), dtype=np.int64)
        self.num_tokens = int(self._ends[-1]) if len(self._ends) else 0
        targets = max(self.num_tokens - 1, 0)
        self.num_samples = (-(-targets // self.seq_len) if partial_last
                            else targets // self.seq_len)
        if seed is not None and self.num_samples < epoch_multiple:
            raise ValueError(
                f"data: {self.num_tokens} tokens make {self.num_samples} windows of "
                f"data.seq_len={seq_len}, fewer than one batch of {epoch_multiple} (needs "
                f"{epoch_multiple * seq_len + 1} tokens: add text, or lower data.seq_len "
                f"or data.micro_batch_size)")
        self._per_epoch = (self.num_samples - self.num_samples % epoch_multiple
                           if seed is not None else self.num_samples)
        self._orders = RecentCache(2)

    @property
    def tokens(self) -> np.ndarray:
        """The corpus as one array (a dataset made of one document: the text corpora)."""
        if len(self.documents) != 1:
            raise ValueError("tokens: only a dataset of one document is one array")
        return self.documents[0]

    def __len__(self) -> int:
        return self.num_samples

    @property
    def distinct_samples(self) -> int:
        return self._per_epoch

    def fingerprint(self) -> list:
        return [self.num_samples]

    def window(self, k: int) -> int:
        """Stream sample ``k`` -> its window."""
        epoch, position = divmod(int(k), self._per_epoch)
        if self.seed is None:
            return position
        order = self._orders.get(epoch, lambda: np.random.default_rng(
            [self.seed, epoch]).permutation(self.num_samples))
        return int(order[position])

    def __getitem__(self, k: int) -> dict:
        start = self.window(k) * self.seq_len
        end = min(start + self.seq_len + 1, self.num_tokens)
        return make_row(self._pieces(start, end), self.seq_len, self.document_mask,
                        self.pad_id)

    def _pieces(self, start: int, end: int) -> list[np.ndarray]:
        """Tokens ``[start, end)`` of the concatenation, one piece per document."""
        pieces = []
        d = int(np.searchsorted(self._ends, start, side="right"))
        while start < end:
            first = int(self._ends[d - 1]) if d else 0
            piece = self._document(d)[start - first:min(end, int(self._ends[d])) - first]
            if len(piece):
                pieces.append(piece)
            start, d = max(start, int(self._ends[d])), d + 1
        return pieces

    def _document(self, d: int) -> np.ndarray:
        if isinstance(self.documents, IndexedDataset):
            return self.documents.document(d)
        return self.documents[d]


def _document_lengths(documents) -> np.ndarray:
    if isinstance(documents, IndexedDataset):  # documents group sequences: add them up
        ends = np.r_[0, np.cumsum(documents.sequence_lengths, dtype=np.int64)]
        return np.diff(ends[documents.document_indices])
    return np.array([len(d) for d in documents], dtype=np.int64)
