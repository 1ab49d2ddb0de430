"""``lmforge preprocess``: raw text files -> Megatron indexed datasets (PREFIX.bin/.idx).

Inputs are files or directories (walked in sorted order) of ``.jsonl``, ``.jsonl.gz``,
``.json`` (one array of objects), ``.txt`` (one document per file) and ``.parquet``
(``.json.gz`` and ``.txt.gz`` too). Memory stays flat whatever the input size:

* the main process reads each file in blocks of ``--chunk-mb`` cut at line ends and keeps
  at most ``2 x workers`` blocks in flight; the workers parse, check and tokenize them;
* results are written in input order as they arrive (streamed to a temporary
  ``PREFIX.bin``; the per-document lengths spill to a side file), so the peak is about
  ``workers x chunk`` plus a fixed cost, not a multiple of the input;
* the files are renamed to their final names only once complete.

Bad records stop the run with ``file:line: reason`` (for parquet the line is the 1-based
row); ``--on-error skip`` skips them and reports how many and where. Empty or
whitespace-only documents are never an error: they are left out and counted. A ``.json``
array with a syntax error always stops (nothing after it can be read reliably).
"""
from __future__ import annotations

import codecs
import gzip
import json
import multiprocessing as mp
import os
import sys
import time
import zlib
from collections import deque
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np

from lmforge.data.errors import DataError
from lmforge.data.indexed import IndexedDatasetWriter, bin_path, idx_path, token_dtype

SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".txt", ".txt.gz", ".parquet")
_MAX_RECORD_BYTES = 256 << 20  # a single .json element larger than this is refused
_SHOWN_ERRORS = 10

# ------------------------------------------------------------------------ input files

def find_inputs(paths: list[str | Path]) -> list[Path]:
    """Files as given, directories walked (sorted); refuses what we cannot read."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and _suffix(f)
                           and not _skipped_dir(f.relative_to(p)))
            if not found:
                raise DataError(f"{p}: no usable input files (looked for "
                                f"{', '.join(SUFFIXES)})")
            files.extend(found)
        elif p.is_file():
            if not _suffix(p):
                raise DataError(f"{p}: unsupported file type (use {', '.join(SUFFIXES)})")
            files.append(p)
        else:
            raise DataError(f"{p}: no such file or directory")
    return files


def _skipped_dir(relative: Path) -> bool:
    """Hidden files and folders, and lmforge's own caches, are not inputs."""
    return any(part.startswith(".") or part.endswith((".lmforge-index", ".lmforge-sft"))
               for part in relative.parts)


def _suffix(path: Path) -> Optional[str]:
    name = path.name.lower()
    return next((s for s in sorted(SUFFIXES, key=len, reverse=True) if name.endswith(s)),
                None)


# -------------------------------------------------------------------- reading (main)
#
# A chunk is a small picklable tuple, one of:
#   ("lines",   path, first_line, bytes)         JSON Lines, cut at a line end
#   ("records", path, [(line, object), ...])     already parsed (.json arrays, parquet)
#   ("text",    path, first_line, bytes, final)  a piece of one .txt document

class _Progress:
    """Bytes read so far across files (compressed bytes for .gz)."""

    def __init__(self, callback: Optional[Callable[[int], None]]):
        self.callback, self.done = callback, 0

    def advance_to(self, base: int, pos: int) -> None:
        if self.callback and base + pos > self.done:
            self.callback(base + pos - self.done)
            self.done = base + pos


def iter_chunks(files: list[Path], keys: list[str], chunk_bytes: int,
                progress: Optional[Callable[[int], None]] = None) -> Iterator[tuple]:
    tracker = _Progress(progress)
    base = 0
    for path in files:
        kind = _suffix(path)
        size = path.stat().st_size
        if kind == ".parquet":
            for fraction, chunk in _parquet_chunks(path, keys, chunk_bytes):
                yield chunk
                tracker.advance_to(base, int(fraction * size))
        else:
            with open(path, "rb") as raw:
                stream = gzip.GzipFile(fileobj=raw) if kind.endswith(".gz") else raw
                report = lambda: tracker.advance_to(base, raw.tell())  # noqa: E731
                try:
                    if kind.startswith(".jsonl"):
                        yield from _line_chunks(path, stream, chunk_bytes, report)
                    elif kind.startswith(".json"):
                        yield from _json_array_chunks(path, stream, keys, chunk_bytes, report)
                    else:  # smaller pieces: one piece is one tokenizer call
                        yield from _text_chunks(path, stream, min(chunk_bytes, 64 << 10),
                                                report)
                except (OSError, EOFError, zlib.error) as e:
                    raise DataError(f"{path}: cannot read ({_one_line(e)})") from None
        base += size
        tracker.advance_to(base, 0)


def _blocks(stream, chunk_bytes: int) -> Iterator[bytes]:
    """Blocks of about ``chunk_bytes`` that end at a newline (the last one may not)."""
    rest = b""
    while True:
        data = stream.read(chunk_bytes)
        if not data:
            if rest:
                yield rest
            return
        data = rest + data if rest else data
        cut = data.rfind(b"\n") + 1
        if cut == 0:  # a line longer than the chunk: keep reading until it ends
            rest = data
            continue
        yield data[:cut]
        rest = data[cut:]


def _line_chunks(path: Path, stream, chunk_bytes: int, report) -> Iterator[tuple]:
    line = 1
    for block in _blocks(stream, chunk_bytes):
        yield ("lines", str(path), line, block)
        line += block.count(b"\n")
        report()


def _text_chunks(path: Path, stream, chunk_bytes: int, report) -> Iterator[tuple]:
    line, previous = 1, None
    for block in _blocks(stream, chunk_bytes):
        if previous is not None:
            yield ("text", str(path), previous[0], previous[1], False)
        previous = (line, block)
        line += block.count(b"\n")
        report()
    yield ("text", str(path), previous[0] if previous else 1,
           previous[1] if previous else b"", True)


def _json_array_chunks(path: Path, stream, keys: list[str], chunk_bytes: int,
                       report) -> Iterator[tuple]:
    """Streams the elements of one top-level JSON array without loading the file."""
    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")()
    buf, pos, line, eof = "", 0, 1, False
    records, size = [], 0

    def more() -> bool:
        nonlocal buf, pos, eof
        if eof:
            return False
        data = stream.read(chunk_bytes)
        report()
        try:
            text = utf8.decode(data, final=not data)
        except UnicodeDecodeError as e:
            bad_line = line + buf[pos:].count("\n") + e.object[:e.start].count(b"\n")
            raise DataError(f"{path}:{bad_line}: not valid UTF-8 "
                            f"(byte 0x{e.object[e.start]:02x})") from None
        eof = not data
        buf = buf[pos:] + text
        pos = 0
        return True

    def skip_space() -> bool:  # False at the end of input
        nonlocal pos, line
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n":
                line += buf[pos] == "\n"
                pos += 1
            if pos < len(buf):
                return True
            if not more():
                return False

    if not skip_space() or buf[pos] != "[":
        raise DataError(f"{path}:{line}: a .json file must hold one array of objects "
                        "(use .jsonl for one object per line)")
    pos += 1
    first = True
    while True:
        if not skip_space():
            raise DataError(f"{path}:{line}: not valid JSON (the array is not closed)")
        if buf[pos] == "]":
            pos += 1
            if skip_space():
                raise DataError(f"{path}:{line}: not valid JSON (text after the array)")
            break
        if not first:
            if buf[pos] != ",":
                raise DataError(f"{path}:{line}: not valid JSON (expected ',' or ']')")
            pos += 1
            if not skip_space():
                raise DataError(f"{path}:{line}: not valid JSON (the array is not closed)")
        first = False
        while True:
            try:
                obj, end = decoder.raw_decode(buf, pos)
                break
            except json.JSONDecodeError as e:
                # Maybe only cut by the read: read on, up to a bound.
                if len(buf) - pos > _MAX_RECORD_BYTES or not more():
                    where = line + buf[pos:e.pos].count("\n")
                    raise DataError(f"{path}:{where}: not valid JSON ({e.msg})") from None
        records.append((line, _pick(obj, keys)))
        size += end - pos
        line += buf.count("\n", pos, end)
        pos = end
        if size >= chunk_bytes:
            yield ("records", str(path), records)
            records, size = [], 0
    if records:
        yield ("records", str(path), records)


def _pick(obj, keys: list[str]):
    """Only the keys we need travel to the workers."""
    if isinstance(obj, dict):
        return {k: obj[k] for k in keys if k in obj} | {"__keys__": list(obj)[:8]}
    return obj


def _parquet_chunks(path: Path, keys: list[str], chunk_bytes: int) -> Iterator[tuple]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from None
    try:
        pf = pq.ParquetFile(str(path))
    except Exception as e:  # pyarrow raises its own ArrowInvalid etc.
        raise DataError(f"{path}: not a readable parquet file ({_one_line(e)})") from None
    columns = pf.schema_arrow.names
    missing = [k for k in keys if k not in columns]
    if missing:
        raise DataError(f"{path}: no column {missing[0]!r} (columns: {', '.join(columns)})")
    # Rows per batch from the columns' uncompressed size, so a batch is about one chunk.
    meta, wanted = pf.metadata, {columns.index(k) for k in keys}
    total = sum(meta.row_group(g).column(c).total_uncompressed_size
                for g in range(meta.num_row_groups) for c in wanted)
    rows = max(1, min(65536, chunk_bytes * max(meta.num_rows, 1) // max(total, 1)))
    row = 1
    for batch in pf.iter_batches(batch_size=rows, columns=keys):
        values = {k: batch.column(k).to_pylist() for k in keys}
        records = [(row + i, {k: values[k][i] for k in keys}) for i in range(batch.num_rows)]
        row += batch.num_rows
        yield (row - 1) / max(meta.num_rows, 1), ("records", str(path), records)


# --------------------------------------------------------------------- work (workers)

_WORKER: dict = {}


def _init_worker(tokenizer_dir: str, keys: list[str], append_eod: bool,
                 special_tokens: bool) -> None:
    # Parallelism comes from the worker processes. The tokenizer's own thread pool adds
    # no speed on top (measured, bench/preprocess.py) but raises and scatters memory.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from lmforge.data.tokenizer import load_tokenizer

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
        items = _parse_lines(chunk[3], chunk[2]) if chunk[0] == "lines" else chunk[2]
        return _tokenize_records(path, items)
    except DataError:
        raise
    except Exception as e:  # never a bare traceback from a worker
        raise DataError(f"{chunk[1]}:{chunk[2] if chunk[0] != 'records' else 1}: "
                        f"could not process ({type(e).__name__}: {_one_line(e)})") from None


def _parse_lines(block: bytes, first_line: int) -> list:
    items = []
    for i, raw in enumerate(block.split(b"\n")):
        if not raw.strip():
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            items.append((first_line + i, ("error", f"not valid UTF-8 (byte 0x"
                                           f"{e.object[e.start]:02x} at column {e.start + 1})")))
            continue
        try:
            items.append((first_line + i, json.loads(text)))
        except json.JSONDecodeError as e:
            items.append((first_line + i, ("error", f"not valid JSON ({e.msg}, column "
                                           f"{e.colno})")))
    return items


def _check(obj, keys: list[str]):
    """The texts of a record, or a reason why it is bad."""
    if isinstance(obj, tuple) and obj and obj[0] == "error":
        return obj[1]
    if not isinstance(obj, dict):
        return f"expected a JSON object, got {_json_type(obj)}"
    texts = []
    for key in keys:
        if key not in obj:
            seen = obj.get("__keys__", [k for k in obj if k != "__keys__"])
            return f"no key {key!r} (keys: {', '.join(map(str, seen)) or 'none'})"
        value = obj[key]
        if not isinstance(value, str):
            return f"key {key!r} is {_json_type(value)}, not a string"
        texts.append(value)
    return texts


def _json_type(value) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
            int: "a number", float: "a number", type(None): "null"}.get(type(value),
                                                                         type(value).__name__)


def _tokenize_records(path: str, items: list) -> ChunkResult:
    keys = _WORKER["keys"]
    per_key: list[list[str]] = [[] for _ in keys]
    errors, empty = [], [0] * len(keys)
    for line, obj in items:
        texts = _check(obj, keys)
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


# ------------------------------------------------------------------------ the run

@dataclass
class Output:
    key: str
    prefix: str
    documents: int = 0
    tokens: int = 0
    empty: int = 0


@dataclass
class PreprocessStats:
    outputs: list[Output]
    files: int = 0
    records: int = 0
    seconds: float = 0.0
    skipped: int = 0
    skipped_where: list[str] = field(default_factory=list)
    skipped_per_file: dict[str, int] = field(default_factory=dict)

    @property
    def documents(self) -> int:
        return sum(o.documents for o in self.outputs)

    @property
    def tokens(self) -> int:
        return sum(o.tokens for o in self.outputs)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> str:
        lines = []
        for o in self.outputs:
            lines.append(f"wrote {o.prefix}.bin/.idx: {o.documents:,} documents, "
                         f"{o.tokens:,} tokens" + (f" ({o.empty:,} empty documents left out)"
                                                   if o.empty else ""))
        lines.append(f"{self.files} file(s), {self.documents:,} documents, {self.tokens:,} "
                     f"tokens in {self.seconds:.1f} s ({self.tokens_per_s:,.0f} tokens/s)")
        if self.skipped:
            per_file = ", ".join(f"{p}: {n}" for p, n in self.skipped_per_file.items())
            lines.append(f"skipped {self.skipped:,} bad record(s) ({per_file})")
            lines.extend(f"  {w}" for w in self.skipped_where)
            if self.skipped > len(self.skipped_where):
                lines.append(f"  ... and {self.skipped - len(self.skipped_where):,} more")
        return "\n".join(lines)


def output_prefixes(prefix: str, keys: list[str]) -> list[str]:
    """One key: PREFIX; several: PREFIX_{key}_document (Megatron's naming)."""
    if len(keys) == 1:
        return [prefix]
    return [f"{prefix}_{key}_document" for key in keys]


def preprocess(inputs: list[str | Path], output_prefix: str | Path, tokenizer_dir: str | Path,
               json_keys: tuple[str, ...] = ("text",), append_eod: bool = False,
               workers: int = 1, on_error: str = "stop", chunk_mb: float = 1.0,
               progress: bool = False, special_tokens: str = "tokenizer") -> PreprocessStats:
    """Tokenizes ``inputs`` into indexed datasets; returns the counts. Raises DataError.

    ``special_tokens="tokenizer"`` keeps what the tokenizer adds to a text (BOS for
    Llama-2/3, as Megatron-LM's preprocessing does); ``"none"`` keeps the text's tokens
    only. ``append_eod`` then ends each document with the end-of-text token."""
    from lmforge.data.tokenizer import TokenizerError, load_tokenizer

    if on_error not in ("stop", "skip"):
        raise DataError(f"--on-error: {on_error!r} is not one of stop, skip")
    if workers < 1:
        raise DataError(f"--workers: must be >= 1, got {workers}")
    if special_tokens not in ("tokenizer", "none"):
        raise DataError(f"--special-tokens: {special_tokens!r} is not one of tokenizer, none")
    keys = list(dict.fromkeys(json_keys))
    files = find_inputs(list(inputs))
    if len(keys) > 1 and any(_suffix(f).startswith(".txt") for f in files):
        raise DataError("--json-key: several keys need JSON or parquet inputs "
                        "(a .txt file has no keys)")
    try:
        tok = load_tokenizer(tokenizer_dir)
    except TokenizerError as e:
        raise DataError(f"--tokenizer: {e}") from None
    if append_eod and tok.eos_id is None:
        raise DataError(f"--append-eod: the tokenizer in {tokenizer_dir} has no end-of-text "
                        "token")
    dtype = token_dtype(tok.vocab_size)
    chunk_bytes = max(4096, int(chunk_mb * (1 << 20)))
    stats = PreprocessStats([Output(k, p) for k, p in
                             zip(keys, output_prefixes(str(output_prefix), keys))],
                            files=len(files))
    writers = [IndexedDatasetWriter(o.prefix, dtype) for o in stats.outputs]
    bar = _progress_bar(sum(f.stat().st_size for f in files), progress)
    start = time.perf_counter()
    text_doc = {"tokens": 0, "content": False}
    prefix, suffix = tok.affixes if special_tokens == "tokenizer" else ([], [])
    text_ends = (prefix, suffix + ([tok.eos_id] if append_eod else []))
    try:
        chunks = iter_chunks(files, keys, chunk_bytes, bar.update if bar else None)
        init = (str(tokenizer_dir), keys, append_eod, special_tokens == "tokenizer")
        for result in _run(chunks, workers, init):
            _consume(result, stats, writers, on_error, text_ends, text_doc)
            if bar:
                bar.set_postfix(docs=stats.documents, tokens=stats.tokens, refresh=False)
        for w in writers:
            w.finalize()
    except BaseException:
        for w in writers:
            w.abort()
        raise
    finally:
        if bar:
            bar.close()
    stats.seconds = time.perf_counter() - start
    return stats


def _run(chunks: Iterator[tuple], workers: int, init: tuple) -> Iterator[ChunkResult]:
    """Results in input order; at most 2 x workers chunks in flight."""
    if workers == 1:
        _init_worker(*init)
        yield from map(process_chunk, chunks)
        return
    # spawn: workers start clean (no copied parent memory, no forked tokenizer threads)
    pool = mp.get_context("spawn").Pool(workers, initializer=_init_worker, initargs=init)
    try:
        pending: deque = deque()
        for chunk in chunks:
            pending.append(pool.apply_async(process_chunk, (chunk,)))
            while len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
        pool.close()
    finally:
        pool.terminate()
        pool.join()


def _consume(r: ChunkResult, stats: PreprocessStats, writers: list, on_error: str,
             text_ends: tuple[list, list], text_doc: dict) -> None:
    stats.records += r.records
    for line, reason in r.errors:
        if on_error == "stop":
            raise DataError(f"{r.path}:{line}: {reason}")
        stats.skipped += 1
        stats.skipped_per_file[r.path] = stats.skipped_per_file.get(r.path, 0) + 1
        if len(stats.skipped_where) < _SHOWN_ERRORS:
            stats.skipped_where.append(f"{r.path}:{line}: {reason}")
    if r.final is not None:  # a piece of a .txt document
        _consume_text(r, stats.outputs[0], writers[0], text_ends, text_doc)
        return
    for out, w, tokens, lengths, empty in zip(stats.outputs, writers, r.tokens, r.lengths,
                                              r.empty):
        w.add_documents(tokens, lengths)
        out.documents += len(lengths)
        out.tokens += int(tokens.size)
        out.empty += empty


def _consume_text(r: ChunkResult, out: Output, w: IndexedDatasetWriter,
                  ends: tuple[list, list], doc: dict) -> None:
    """Pieces of one .txt document: ``ends`` = (ids before it, ids after it)."""
    if r.errors:  # (skip mode) a bad piece drops the whole document
        doc["bad"] = True
    elif not doc.get("bad"):
        if not doc.get("started"):
            w.write(np.asarray(ends[0]))
            doc["tokens"] += len(ends[0])
            doc["started"] = True
        w.write(r.tokens[0])
        doc["tokens"] += int(r.tokens[0].size)
        doc["content"] |= not r.blank
    if not r.final:
        return
    if doc.get("bad") or not doc["content"]:
        w.discard_open_sequence()
        out.empty += not doc.get("bad")
    else:
        w.write(np.asarray(ends[1]))
        doc["tokens"] += len(ends[1])
        w.end_document()
        out.documents += 1
        out.tokens += doc["tokens"]
    doc.update(tokens=0, content=False, bad=False, started=False)


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                desc="preprocess", dynamic_ncols=True)


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text or type(err).__name__


__all__ = ["preprocess", "find_inputs", "output_prefixes",
           "PreprocessStats", "bin_path", "idx_path"]
