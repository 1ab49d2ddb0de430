"""Megatron-LM's indexed dataset ("MMIDIDX", version 1): ``PREFIX.bin`` holds the token ids
of every sequence back to back, ``PREFIX.idx`` says where each one starts.

``.idx`` layout (little-endian)::

    9 bytes   b"MMIDIDX\\x00\\x00"
    u64       version = 1
    u8        dtype code of the tokens (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
              6 float64, 7 float32, 8 uint16)
    u64       sequence count S
    u64       document count D + 1 (the length of the document index below)
    i32[S]    sequence lengths, in tokens
    i64[S]    sequence pointers, in bytes from the start of .bin
    i64[D+1]  document index: sequence ids where documents start, from 0 to S

Our preprocessing writes one sequence per document, as Megatron's ``preprocess_data.py``
does without sentence splitting. The writer keeps its memory flat whatever the size of the
dataset (lengths are spilled to a side file) and renames the files into place only once
they are complete. The reader maps both files and never copies tokens.

The pair's file names, its record (``PREFIX.pair``) and the index checks the reader
runs are in ``lmforge.data.indexed_files``.
"""
from __future__ import annotations

import json
import os
import struct
from array import array
from pathlib import Path
from typing import Iterable, Optional

import numpy as np

from lmforge import fsio
from lmforge.data.errors import DataError
from lmforge.data.indexed_files import (bin_path, check_documents, check_pair,
                                        check_sequences, idx_path, pair_path, pair_record,
                                        strip_suffix)

HEADER = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8), 2: np.dtype(np.int8), 3: np.dtype(np.int16), 4: np.dtype(np.int32),
    5: np.dtype(np.int64), 6: np.dtype(np.float64), 7: np.dtype(np.float32),
    8: np.dtype(np.uint16)}
CODES: dict[np.dtype, int] = {dtype: code for code, dtype in DTYPES.items()}
_FIXED = len(HEADER) + 8 + 1 + 8 + 8  # bytes before the arrays


def token_dtype(vocab_size: int) -> np.dtype:
    """Megatron's choice: uint16 below 65,500 ids, int32 otherwise."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


# ------------------------------------------------------------------------------ writer

class IndexedDatasetWriter:
    """Streams tokens to ``PREFIX.bin`` and writes ``PREFIX.idx`` at ``finalize()``.

    Both files are written under temporary names and renamed when complete, so a crash
    or an error never leaves a half-written dataset under the final name. Use as a context
    manager: a clean exit finalizes, an exception removes the temporary files.
    """

    _SPILL_ITEMS = 1 << 20  # lengths kept in RAM before they go to the side file

    def __init__(self, prefix: str | Path, dtype=np.uint16):
        self.prefix = str(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODES:
            raise DataError(f"{self.prefix}: token dtype {self.dtype} has no MMIDIDX code")
        tag = fsio.tmp_tag()
        self._tmp_bin, self._tmp_idx = bin_path(self.prefix) + tag, idx_path(self.prefix) + tag
        self._tmp_lengths = f"{self.prefix}.lengths{tag}"
        self._tmp_docs = f"{self.prefix}.docs{tag}"
        self._tmp_pair = pair_path(self.prefix) + tag
        for tmp in (self._tmp_bin, self._tmp_idx, self._tmp_lengths, self._tmp_docs,
                    self._tmp_pair):  # a killed writer's, this host's, dead pid's
            fsio.remove_stale_temporaries(tmp.removesuffix(tag))
        Path(self._tmp_bin).parent.mkdir(parents=True, exist_ok=True)
        self._bin = open(self._tmp_bin, "wb")
        self._lengths_file = open(self._tmp_lengths, "w+b")
        self._docs_file = open(self._tmp_docs, "w+b")
        self._lengths = array("i")  # int32, as in the .idx
        self._doc_starts = array("q")  # int64: sequence id where each document ends
        self.num_sequences = 0
        self.num_documents = 0
        self.num_tokens = 0
        self._open_length = 0  # tokens written to the sequence not yet ended
        self._done = False

    # -- adding tokens
    def write(self, tokens) -> None:
        """Appends tokens to the open sequence (``end_sequence`` closes it)."""
        arr = np.asarray(tokens)
        if arr.size:
            self._bin.write(np.ascontiguousarray(arr, dtype=self.dtype).tobytes())
            self._open_length += int(arr.size)
            self.num_tokens += int(arr.size)

    def end_sequence(self) -> None:
        if self._open_length >= 2 ** 31:
            raise DataError(f"{self.prefix}: a sequence of {self._open_length} tokens does "
                            "not fit the format's int32 length")
        self._lengths.append(self._open_length)
        self.num_sequences += 1
        self._open_length = 0
        if len(self._lengths) >= self._SPILL_ITEMS:
            self._lengths.tofile(self._lengths_file)
            self._lengths = array("i")

    def discard_open_sequence(self) -> None:
        """Drops the tokens written since the last ``end_sequence``."""
        if self._open_length:
            self._bin.seek(-self._open_length * self.dtype.itemsize, os.SEEK_CUR)
            self._bin.truncate()
            self.num_tokens -= self._open_length
            self._open_length = 0

    def end_document(self) -> None:
        """Closes the open sequence (if it holds tokens) and the document."""
        if self._open_length:
            self.end_sequence()
        self._record_document_end()

    def _record_document_end(self) -> None:
        self._doc_starts.append(self.num_sequences)
        self.num_documents += 1
        if len(self._doc_starts) >= self._SPILL_ITEMS:
            self._doc_starts.tofile(self._docs_file)
            self._doc_starts = array("q")

    def add_document(self, tokens, sequence_lengths: Optional[Iterable[int]] = None) -> None:
        """One document; several sequences when ``sequence_lengths`` splits it."""
        arr = np.asarray(tokens)
        if sequence_lengths is None:
            self.write(arr)
            self.end_sequence()
        else:
            lengths = [int(n) for n in sequence_lengths]
            if sum(lengths) != arr.size:
                raise ValueError(f"sequence lengths sum to {sum(lengths)}, not {arr.size}")
            self.write(arr)
            self._open_length = 0
            for n in lengths:
                self._open_length = n
                self.end_sequence()
        self.end_document()

    def add_documents(self, flat_tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Many one-sequence documents at once: ``flat_tokens`` split by ``lengths``."""
        lengths = np.asarray(lengths, dtype=np.int64)
        if int(lengths.sum()) != np.asarray(flat_tokens).size:
            raise ValueError("lengths do not add up to the number of tokens")
        if self._open_length:
            raise ValueError("add_documents with a sequence still open")
        self.write(flat_tokens)
        self._open_length = 0
        for n in lengths.tolist():
            self._open_length = n
            self.end_sequence()
            self._record_document_end()

    # -- finishing
    def finalize(self) -> None:
        if self._done:
            return
        if self._open_length:
            self.end_document()
        self._bin.close()
        self._lengths.tofile(self._lengths_file)
        self._doc_starts.tofile(self._docs_file)
        self._lengths, self._doc_starts = array("i"), array("q")
        self._write_index()
        self._lengths_file.close()
        self._docs_file.close()
        fsio.write_file(self._tmp_pair, json.dumps(pair_record(
            self._tmp_bin, self._tmp_idx)).encode())
        fsio.replace_file(self._tmp_bin, bin_path(self.prefix))
        fsio.replace_file(self._tmp_idx, idx_path(self.prefix))
        fsio.replace_file(self._tmp_pair, pair_path(self.prefix))
        for tmp in (self._tmp_lengths, self._tmp_docs):
            os.unlink(tmp)
        self._done = True

    def _write_index(self) -> None:
        chunk = self._SPILL_ITEMS
        itemsize = self.dtype.itemsize
        with open(self._tmp_idx, "wb") as out:
            out.write(HEADER)
            out.write(struct.pack("<Q", VERSION))
            out.write(struct.pack("<B", CODES[self.dtype]))
            out.write(struct.pack("<Q", self.num_sequences))
            out.write(struct.pack("<Q", self.num_documents + 1))
            self._lengths_file.seek(0)
            for block in iter(lambda: self._lengths_file.read(4 * chunk), b""):
                out.write(block)
            # Pointers are running byte offsets; computed block by block to stay flat.
            self._lengths_file.seek(0)
            offset = 0
            for block in iter(lambda: self._lengths_file.read(4 * chunk), b""):
                lengths = np.frombuffer(block, dtype=np.int32).astype(np.int64)
                ends = np.cumsum(lengths) * itemsize + offset
                out.write((ends - lengths * itemsize).tobytes())
                offset = int(ends[-1])
            out.write(struct.pack("<q", 0))
            self._docs_file.seek(0)
            for block in iter(lambda: self._docs_file.read(8 * chunk), b""):
                out.write(block)

    def abort(self) -> None:
        """Closes and removes every temporary file (the final names are untouched)."""
        if self._done:
            return
        for f in (self._bin, self._lengths_file, self._docs_file):
            f.close()
        for tmp in (self._tmp_bin, self._tmp_idx, self._tmp_lengths, self._tmp_docs,
                    self._tmp_pair):
            if os.path.exists(tmp):
                os.unlink(tmp)
        self._done = True

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


# ------------------------------------------------------------------------------ reader

class IndexedDataset:
    """Zero-copy reader: every array here is a view into a memory map.

    ``ds[i]`` is sequence ``i`` (a read-only numpy view), ``ds.document(d)`` the tokens of
    document ``d``, ``ds.tokens`` the whole ``.bin`` as one array.
    """

    def __init__(self, prefix: str | Path):
        self.prefix = strip_suffix(prefix)
        self._open()

    def _open(self) -> None:
        idx, binp = idx_path(self.prefix), bin_path(self.prefix)
        for path in (idx, binp):
            if not os.path.isfile(path):
                raise DataError(f"{path}: not found (expected a Megatron PREFIX.bin/.idx pair)")
        with open(idx, "rb") as f:
            head = f.read(_FIXED)
        if len(head) < _FIXED or head[:len(HEADER)] != HEADER:
            raise DataError(f"{idx}: not an MMIDIDX index (bad header)")
        version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[len(HEADER):])
        if version != VERSION:
            raise DataError(f"{idx}: index version {version}, only version 1 is supported")
        if code not in DTYPES:
            raise DataError(f"{idx}: unknown token dtype code {code}")
        self.dtype = DTYPES[code]
        expected = _FIXED + n_seq * (4 + 8) + n_doc * 8
        size = os.path.getsize(idx)
        if size < expected:
            raise DataError(f"{idx}: truncated ({size} bytes, the header promises {expected})")
        if size not in (expected, expected + n_seq):  # + n_seq: Megatron's multimodal modes
            raise DataError(f"{idx}: {size} bytes, but the header's {n_seq} sequences and "
                            f"{n_doc - 1} documents make {expected}")
        self._idx = np.memmap(idx, dtype=np.uint8, mode="r")
        self.sequence_lengths = np.frombuffer(self._idx, np.int32, n_seq, _FIXED)
        self.sequence_pointers = np.frombuffer(self._idx, np.int64, n_seq, _FIXED + 4 * n_seq)
        self.document_indices = np.frombuffer(self._idx, np.int64, n_doc, _FIXED + 12 * n_seq)
        bin_size = os.path.getsize(binp)
        if bin_size % self.dtype.itemsize:
            raise DataError(f"{binp}: size {bin_size} is not a multiple of the "
                            f"{self.dtype} token size")
        check_sequences(idx, binp, self.sequence_lengths, self.sequence_pointers,
                         self.dtype.itemsize, bin_size)
        check_documents(idx, self.document_indices, n_seq)
        check_pair(self.prefix)  # after the checks above, which say more where they fail
        self.tokens = (np.memmap(binp, dtype=self.dtype, mode="r") if bin_size
                       else np.empty(0, dtype=self.dtype))
        self._num_tokens: Optional[int] = None

    # Pickling (DataLoader workers under spawn) reopens the maps instead of copying them.
    def __getstate__(self) -> dict:
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict) -> None:
        self.prefix = state["prefix"]
        self._open()

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_sequences(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        if self._num_tokens is None:
            self._num_tokens = int(self.sequence_lengths.sum(dtype=np.int64))
        return self._num_tokens

    def _start(self, i: int) -> int:
        return int(self.sequence_pointers[i]) // self.dtype.itemsize

    def __getitem__(self, i: int) -> np.ndarray:
        if not -len(self) <= i < len(self):
            raise IndexError(f"sequence {i} out of range ({len(self)} sequences)")
        i = i % len(self)
        start = self._start(i)
        return self.tokens[start:start + int(self.sequence_lengths[i])]

    def get(self, i: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens ``offset:offset+length`` of sequence ``i``."""
        n = int(self.sequence_lengths[i])
        end = n if length is None else min(n, offset + length)
        start = self._start(i)
        return self.tokens[start + offset:start + end]

    def document(self, d: int) -> np.ndarray:
        """All tokens of document ``d`` (its sequences are contiguous in ``.bin``)."""
        first, last = int(self.document_indices[d]), int(self.document_indices[d + 1])
        if first == last:
            return self.tokens[:0]
        start = self._start(first)
        end = self._start(last - 1) + int(self.sequence_lengths[last - 1])
        return self.tokens[start:end]

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]
