"""The files of an indexed dataset (``PREFIX.bin``, ``PREFIX.idx``, ``PREFIX.pair``):
their names, the pair record, and the checks the reader runs before it trusts an index.

The two renames are separate steps, so the writer also leaves ``PREFIX.pair``, a record of
the pair (each file's size and a hash of 16 blocks of 4 KiB spread over it; outside the
two files, so Megatron reads them unchanged). The reader checks it first and refuses a
``.bin`` and ``.idx`` from two different writes (two jobs that raced, or a pair read while
it is replaced) naming both files. A pair without the record (Megatron's, an older
lmforge's) opens as before; the index checks below still apply to it.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Optional

import numpy as np

from lmforge.data.errors import DataError


def bin_path(prefix: str | Path) -> str:
    return f"{prefix}.bin"


def idx_path(prefix: str | Path) -> str:
    return f"{prefix}.idx"


def pair_path(prefix: str | Path) -> str:
    return f"{prefix}.pair"


def strip_suffix(path: str | Path) -> str:
    """``data/x.bin`` or ``data/x.idx`` -> ``data/x``; a prefix is returned unchanged."""
    text = str(path)
    return text[:-4] if text.endswith((".bin", ".idx")) else text


def exists(prefix: str | Path) -> bool:
    return os.path.isfile(idx_path(prefix)) and os.path.isfile(bin_path(prefix))


# -------------------------------------------------------------------------- the pair

_FINGERPRINT_BLOCKS, _FINGERPRINT_BYTES = 16, 4096


def file_fingerprint(path: str) -> dict:
    """A file's size and a hash of ``_FINGERPRINT_BLOCKS`` blocks spread evenly over it
    (the whole file when it is smaller): read in microseconds at every open, and two
    different writes almost surely differ in one of them (a bit flip may not: that is
    not what it is for)."""
    size = os.path.getsize(path)
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        if size <= _FINGERPRINT_BLOCKS * _FINGERPRINT_BYTES:
            digest.update(f.read())
        else:
            last = size - _FINGERPRINT_BYTES
            for k in range(_FINGERPRINT_BLOCKS):
                f.seek(last * k // (_FINGERPRINT_BLOCKS - 1))
                digest.update(f.read(_FINGERPRINT_BYTES))
    return {"bytes": size, "blake2b": digest.hexdigest()}


def pair_record(bin_file: str, idx_file: str) -> dict:
    return {"bin": file_fingerprint(bin_file), "idx": file_fingerprint(idx_file)}


def check_pair(prefix: str) -> None:
    """Refuse a ``.bin`` and ``.idx`` that ``PREFIX.pair`` says were not written together."""
    record_file, binp, idx = pair_path(prefix), bin_path(prefix), idx_path(prefix)
    try:
        with open(record_file, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return  # Megatron's or an older lmforge's pair: the index checks still apply
    try:
        record = json.loads(raw)
        recorded = {"bin": record["bin"], "idx": record["idx"]}
    except (ValueError, TypeError, KeyError):
        raise DataError(f"{record_file}: not a pair record of {binp} and {idx} (remove it "
                        f"if you wrote the pair with another tool)") from None
    actual = pair_record(binp, idx)
    if actual != recorded:
        changed = " and ".join(n for n in ("bin", "idx") if actual[n] != recorded[n])
        raise DataError(
            f"{binp} and {idx} are not one pair: the .{changed} differs from what "
            f"{record_file} recorded (two writes raced, or the pair is being replaced now); "
            f"re-run preprocess, or remove {record_file} if you replaced the files on "
            f"purpose")


# ------------------------------------------------------------------------- index checks
# A wrong length or pointer would silently train on the wrong tokens (or on a window of
# billions of them), so the reader checks the whole index at open. The checks run block by
# block over the memory maps into reused buffers: vectorised, in flat memory whatever the
# index size, and without faulting in fresh pages for temporaries (which cost more than
# the arithmetic).

_CHECK_BLOCK = 1 << 18


def _first_bad(check, n: int) -> Optional[int]:
    """The first ``i < n - 1`` where ``check(start, stop, out)`` (which fills ``out`` with
    one flag per ``i`` in ``[start, stop)``) raises a flag; None when none does."""
    out = np.empty(min(_CHECK_BLOCK, max(n - 1, 0)), dtype=bool)
    for start in range(0, n - 1, _CHECK_BLOCK):
        stop = min(start + _CHECK_BLOCK, n - 1)
        flags = out[:stop - start]
        check(start, stop, flags)
        if flags.any():
            return start + int(np.argmax(flags))
    return None


def check_sequences(idx: str, binp: str, lengths: np.ndarray, pointers: np.ndarray,
                     itemsize: int, bin_size: int) -> None:
    """Pointers start at 0, each is the previous one plus the previous length, and the last
    sequence ends exactly where ``.bin`` does (Megatron writes sequences back to back)."""
    n, held = len(lengths), bin_size // itemsize
    if n == 0:
        if held:
            raise DataError(f"{idx}: no sequences, but {binp} holds {held} tokens")
        return
    if pointers[0] != 0:
        raise DataError(f"{idx}: sequence 0 starts at byte {int(pointers[0])}, not 0")
    ends = np.empty(min(_CHECK_BLOCK, n), dtype=np.int64)

    def disagree(start, stop, flags):
        block = ends[:stop - start]
        np.multiply(lengths[start:stop], itemsize, out=block)
        np.add(block, pointers[start:stop], out=block)
        np.not_equal(block, pointers[start + 1:stop + 1], out=flags)
        flags |= lengths[start:stop] < 0

    i = _first_bad(disagree, n)
    if i is not None:
        apart = (int(pointers[i + 1]) - int(pointers[i])) // itemsize
        raise DataError(f"{idx}: sequence {i} has {int(lengths[i])} tokens but its pointer "
                        f"and the next are {apart} tokens apart (the lengths and pointers "
                        f"disagree)")
    end = (int(pointers[-1]) + int(lengths[-1]) * itemsize) // itemsize
    if lengths[-1] < 0 or end > held:
        raise DataError(f"{idx}: sequence {n - 1} has {int(lengths[-1])} tokens and ends at "
                        f"token {end}, but {binp} holds only {held} tokens (truncated, or "
                        f"not this index's .bin)")
    if end < held:
        raise DataError(f"{idx}: the sequences end at token {end}, but {binp} holds {held} "
                        f"tokens (not this index's .bin?)")


def check_documents(idx: str, starts: np.ndarray, n_seq: int) -> None:
    """The document index runs from 0 to the sequence count and never decreases."""
    if len(starts) == 0 or starts[0] != 0 or starts[-1] != n_seq:
        raise DataError(f"{idx}: the document index must run from 0 to the sequence count "
                        f"{n_seq}")
    d = _first_bad(lambda start, stop, flags: np.less(
        starts[start + 1:stop + 1], starts[start:stop], out=flags), len(starts))
    if d is not None:
        raise DataError(f"{idx}: document {d + 1} starts at sequence {int(starts[d + 1])}, "
                        f"before document {d} (sequence {int(starts[d])})")
