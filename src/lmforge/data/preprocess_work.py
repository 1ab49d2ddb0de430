"""The work of ``lmforge preprocess``'s worker processes: a block of one input file (lines
of records, or a slice of a plain-text document) parsed, checked and tokenized into a
``ChunkResult`` the main process writes in input order (see ``preprocess``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from itertools import chain
from typing import Optional

import numpy as np

from lmforge.data.errors import DataError
from lmforge.data.indexed import token_dtype
from lmforge.data.readers import one_line, parse_lines, record_texts
from lmforge.data.tokenizer import load_tokenizer

# --------------------------------------------------------------------- work (workers)

_WORKER: dict = {}


def init_worker(tokenizer_dir: str, keys: list[str], append_eod: bool,
                 special_tokens: bool) -> None:
    # Parallelism comes from the worker processes. The tokenizer's own thread pool adds
    # no speed on top (measured, bench/preprocess.py) but raises and scatters memory.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    tok = load_tokenizer(tokenizer_dir)
    _WORKER.update(tokenizer=tok, keys=keys, append_eod=append_eod, eod=tok.eos_id,
                   special_tokens=special_tokens, dtype=token_dtype(tok.vocab_size))


@dataclass
class ChunkResult:
    path: str
    tokens: list  # per key: flat np.ndarray of the documents' tokens
    lengths: list  # per key: np.ndarray of document lengths
    empty: list  # per key: documents left out as empty
    errors: list  # [(line, reason)]
    final: Optional[bool] = None  # text pieces: whether this piece ends the document
    blank: bool = False  # text pieces: nothing but whitespace
    records: int = 0


def process_chunk(chunk: tuple) -> ChunkResult:
    """Parse, check and tokenize one chunk (runs in a worker)."""
    try:
        if chunk[0] == "text":
            return _process_text(*chunk[1:])
        path = chunk[1]
        items = parse_lines(chunk[3], chunk[2]) if chunk[0] == "lines" else chunk[2]
        return _tokenize_records(path, items)
    except DataError:
        raise
    except Exception as e:  # never a bare traceback from a worker
        raise DataError(f"{chunk[1]}:{chunk[2] if chunk[0] != 'records' else 1}: "
                        f"could not process ({type(e).__name__}: {one_line(e)})") from None


def _tokenize_records(path: str, items: list) -> ChunkResult:
    keys = _WORKER["keys"]
    per_key: list[list[str]] = [[] for _ in keys]
    errors, empty = [], [0] * len(keys)
    for line, obj in items:
        texts = record_texts(obj, keys)
        if isinstance(texts, str):
            errors.append((line, texts))
            continue
        for k, text in enumerate(texts):
            if text.strip():
                per_key[k].append(text)
            else:
                empty[k] += 1
    tokens, lengths = zip(*(_encode(texts) for texts in per_key))
    return ChunkResult(path, list(tokens), list(lengths), empty, errors, records=len(items))


_ENCODE_CHARS = 64 * 1024  # text per tokenizer call: its Encoding objects cost ~50x that


def _encode(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of ``texts`` (with the special tokens the tokenizer adds, unless
    ``--special-tokens none``; + EOD), flat, with one length per text. Texts go to the
    tokenizer in small batches (a long one alone), so the transient memory is set by the
    longest document, not by the chunk."""
    tok, dtype = _WORKER["tokenizer"], _WORKER["dtype"]
    eod = [_WORKER["eod"]] if _WORKER["append_eod"] else []
    special = _WORKER["special_tokens"]
    flats, lengths = [], []

    # encode_batch_fast skips the character offsets we do not use: less time and memory.
    fast = getattr(getattr(tok, "_tok", None), "encode_batch_fast", None)

    def flush(batch):
        ids = [e.ids for e in fast(batch, add_special_tokens=special)] if fast else \
            tok.encode_batch(batch, special_tokens=special)
        if eod:
            ids = [x + eod for x in ids]
        n = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        flats.append(np.fromiter(chain.from_iterable(ids), dtype=dtype, count=int(n.sum())))
        lengths.append(n)

    batch, chars = [], 0
    for text in texts:
        if batch and chars + len(text) > _ENCODE_CHARS:
            flush(batch)
            batch, chars = [], 0
        batch.append(text)
        chars += len(text)
    if batch:
        flush(batch)
    if not flats:
        return np.empty(0, dtype=dtype), np.empty(0, dtype=np.int64)
    return np.concatenate(flats), np.concatenate(lengths)


def _process_text(path: str, first_line: int, block: bytes, final: bool) -> ChunkResult:
    dtype = _WORKER["dtype"]
    try:
        text = block.decode("utf-8")
    except UnicodeDecodeError as e:
        line = first_line + block[:e.start].count(b"\n")
        column = e.start - (block.rfind(b"\n", 0, e.start) + 1) + 1
        return ChunkResult(path, [], [], [0], [(line, f"not valid UTF-8 (byte 0x"
                                                      f"{e.object[e.start]:02x} at column "
                                                      f"{column})")], final=final)
    # A piece is at most --chunk-mb of text; the document's special tokens go around the
    # whole document (_consume_text), not around each piece.
    ids = np.asarray(_WORKER["tokenizer"].encode(text, special_tokens=False), dtype=dtype) \
        if text else np.empty(0, dtype=dtype)
    return ChunkResult(path, [ids], [], [0], [], final=final, blank=not text.strip())
