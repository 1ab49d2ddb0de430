"""SFT rows: one sample (or several packed ones) as a padded training row, and the
orders that decide which samples share a row or a batch.

Padding (label -100, ``pad_to_multiple_of``): a batch is padded to its longest sample,
rounded up to a multiple of ``pad_to_multiple_of`` (data.pad_to_multiple_of; a few
shapes, so compiled blocks are not recompiled for every length) and at most ``seq_len``;
``None`` pads every row to ``seq_len`` (fixed shapes). The padding is a function of the
batch's samples, so batches stay deterministic and resumable, and trailing padding
changes no loss or gradient (attention is causal and padding has no target).
``padding_share`` estimates the share of padded positions over an epoch.

Grouping by length (``group_size``, data.group_by_length): padding to the longest still
pads short samples that share a batch with long ones, so the epoch's shuffled order is
cut into spans of 64 optimizer steps (``group_size`` samples each), each span sorted by
length, longest first, and cut into steps, whose order is then shuffled with the epoch's
seed (``group_by_length``): a step's micro-batches (and the ranks of one micro-step) hold
samples of similar length. The order stays a function of (seed, epoch, group_size), every
sample is read once per epoch, and only which samples share a batch changes.

Packing (``data.pack``): samples are placed first-fit into rows of ``seq_len`` positions
(16 rows open at a time, in the epoch's shuffled order). Each sample keeps its own
positions from 0, attends only to itself (block-causal mask) and has no target from
another sample, so a packed row gives the same loss and gradients as its samples alone.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from lmforge import IGNORE_INDEX
from lmforge.data.cache import RecentCache
from lmforge.data.dataset import RowDataset, positions_from_segments


# -------------------------------------------------------------------------- rows

def sft_row(samples: list[tuple[np.ndarray, np.ndarray]], seq_len: int, pad_id: int,
            packed: bool, width: Optional[int] = None) -> dict:
    """A row from one sample (cut to ``seq_len + 1`` tokens), or several packed ones
    (with segments/positions), padded to ``width`` positions (default ``seq_len``)."""
    width = seq_len if width is None else width
    inputs, labels, lengths = [], [], []
    for ids, trained in samples:
        ids = np.asarray(ids[:seq_len + 1], dtype=np.int64)  # stored as uint16/int32
        trained = np.asarray(trained[:seq_len + 1], dtype=bool)
        inputs.append(ids[:-1])
        labels.append(np.where(trained[1:], ids[1:], IGNORE_INDEX))
        lengths.append(len(ids) - 1)
    n = sum(lengths)
    if n > width:
        raise ValueError(f"{n} positions do not fit a row of {width}")
    input_ids = np.full(width, pad_id, dtype=np.int64)
    label_row = np.full(width, IGNORE_INDEX, dtype=np.int64)
    if n:
        input_ids[:n] = np.concatenate(inputs)
        label_row[:n] = np.concatenate(labels)
    row = {"input_ids": input_ids, "labels": label_row}
    if packed:
        segments = np.full(width, len(samples), dtype=np.int64)  # padding: own segment
        segments[:n] = np.repeat(np.arange(len(samples)), lengths)
        row["segments"] = segments
        row["positions"] = positions_from_segments(segments)
    return row


def pack_first_fit(order: np.ndarray, sizes: np.ndarray, capacity: int,
                   open_rows: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """Places samples (in ``order``) first-fit into rows of ``capacity`` positions,
    keeping ``open_rows`` rows open. Returns (row offsets (rows + 1,), sample ids)."""
    rows: list[list[int]] = []
    used: list[int] = []
    open_ids: list[int] = []
    for i in order.tolist():
        size = int(sizes[i])
        for r in open_ids:
            if used[r] + size <= capacity:
                rows[r].append(i)
                used[r] += size
                break
        else:
            rows.append([i])
            used.append(size)
            open_ids.append(len(rows) - 1)
            if len(open_ids) > open_rows:
                open_ids.pop(0)
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum([len(r) for r in rows], out=offsets[1:])
    items = np.fromiter((i for r in rows for i in r), dtype=np.int64, count=int(offsets[-1]))
    return offsets, items


def group_by_length(order: np.ndarray, sizes: np.ndarray, group_size: int,
                    rng: np.random.Generator, first: int = 0, span: int = 64) -> np.ndarray:
    """``order`` regrouped so that each run of ``group_size`` samples (one optimizer
    step) holds samples of similar ``sizes``: spans of ``span`` steps are sorted by size,
    longest first, and the whole steps are shuffled with ``rng``. ``first`` samples, the
    end of a step the previous epoch began, stay first, so later steps start on step
    boundaries of the stream; a last partial step stays last."""
    chunk = group_size * span
    spans = [order[i:i + chunk] for i in range(0, len(order), chunk)]
    grouped = np.concatenate([s[np.argsort(-sizes[s], kind="stable")] for s in spans])
    head, body = grouped[:first], grouped[first:]
    steps = len(body) // group_size
    whole = body[:steps * group_size].reshape(steps, group_size)[rng.permutation(steps)]
    return np.concatenate([head, whole.ravel(), body[steps * group_size:]])


# -------------------------------------------------------------------- planned stream

class PlannedRows(RowDataset):
    """A never-ending stream of rows, each holding one sample or several packed ones, an
    epoch at a time: ``_build_epoch_plan(e)`` gives (row offsets, sample ids), row r of
    the epoch holding ids[offsets[r]:offsets[r + 1]]. Packed epochs differ in their row
    counts, so global row k is located by the epochs' starts. Subclasses set ``pack``
    and ``rows`` (the usable samples) and call ``_start_stream()``."""

    pack: bool
    rows: np.ndarray

    @property
    def num_samples(self) -> int:
        """The usable samples (pairs) of this part."""
        return len(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def _start_stream(self) -> None:
        self._epoch_starts = [0]  # global index of each epoch's first row
        self._epochs = RecentCache(2)

    def _build_epoch_plan(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def epoch_plan(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(row offsets, sample ids) of ``epoch``: row r holds ids[offsets[r]:offsets[r+1]]."""
        return self._epochs.get(epoch, lambda: self._build_epoch_plan(epoch))

    def rows_in_epoch(self, epoch: int) -> int:
        return len(self.epoch_plan(epoch)[0]) - 1

    @property
    def distinct_samples(self) -> int:
        """Rows the stream gives before a sample repeats: epoch 0's."""
        return self.rows_in_epoch(0)

    def locate(self, k: int) -> tuple[int, int]:
        """Global row ``k`` -> (epoch, row in that epoch)."""
        k = int(k)
        if not self.pack:
            return divmod(k, len(self.rows))
        while self._epoch_starts[-1] <= k:  # packed epochs differ in length
            e = len(self._epoch_starts) - 1
            self._epoch_starts.append(self._epoch_starts[-1] + self.rows_in_epoch(e))
        e = int(np.searchsorted(self._epoch_starts, k, side="right")) - 1
        return e, k - self._epoch_starts[e]

    def samples_of(self, k: int) -> list[int]:
        epoch, r = self.locate(k)
        offsets, items = self.epoch_plan(epoch)
        return items[offsets[r]:offsets[r + 1]].tolist()
