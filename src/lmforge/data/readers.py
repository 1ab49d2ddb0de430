"""The input formats of ``lmforge preprocess``, and their ``file:line`` errors.

Inputs are files or directories (walked in sorted order) of ``.jsonl``, ``.jsonl.gz``,
``.json`` (one array of objects), ``.txt`` (one document per file) and ``.parquet``
(``.json.gz`` and ``.txt.gz`` too). The main process cuts each file into chunks
(:func:`iter_chunks`) without loading it whole; the workers turn a chunk's raw lines into
records (:func:`parse_lines`) and a record into its texts (:func:`record_texts`).

A chunk is a small picklable tuple, one of:

* ``("lines",   path, first_line, bytes)``         JSON Lines, cut at a line end
* ``("records", path, [(line, object), ...])``     already parsed (.json arrays, parquet)
* ``("text",    path, first_line, bytes, final)``  a piece of one .txt document

A ``.json`` array with a syntax error always stops (nothing after it can be read
reliably); for parquet the "line" of a record is its 1-based row.

Every record passes ``lmforge.data.records``' checks (valid JSON that is no text, such
as a lone surrogate, is a bad record with ``file:line``, like a syntax error).
"""
from __future__ import annotations

import codecs
import gzip
import json
import zlib
from pathlib import Path
from typing import Callable, Iterator, Optional

from lmforge.data.errors import DataError, at
from lmforge.data.records import (SURROGATE_ESCAPE, BadRecord, check_record, one_line,
                                  parse_record, unreadable)

SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".txt", ".txt.gz", ".parquet")
_MAX_RECORD_BYTES = 256 << 20  # a single .json element larger than this is refused
TEXT_PIECE_BYTES = 64 << 10  # a .txt piece is one tokenizer call: keep it small

# ------------------------------------------------------------------------ input files


def find_inputs(paths: list[str | Path]) -> list[Path]:
    """Files as given, directories walked (sorted); refuses what we cannot read."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and input_kind(f)
                           and not skipped_path(f.relative_to(p)))
            if not found:
                raise DataError(f"{p}: no usable input files (looked for "
                                f"{', '.join(SUFFIXES)})")
            files.extend(found)
        elif p.is_file():
            if not input_kind(p):
                raise DataError(f"{p}: unsupported file type (use {', '.join(SUFFIXES)})")
            files.append(p)
        else:
            raise DataError(f"{p}: no such file or directory")
    return files


def skipped_path(relative: Path) -> bool:
    """Hidden files and folders, and lmforge's own caches, are not inputs."""
    return any(part.startswith(".") or part.endswith((".lmforge-index", ".lmforge-sft"))
               for part in relative.parts)


def input_kind(path: Path) -> Optional[str]:
    """The input suffix of ``path`` (one of SUFFIXES, the longest that matches), or None."""
    name = path.name.lower()
    return next((s for s in sorted(SUFFIXES, key=len, reverse=True) if name.endswith(s)),
                None)


# -------------------------------------------------------------------- chunks (main)

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
    """The chunks of ``files`` in order; ``progress`` is called with bytes read."""
    tracker = _Progress(progress)
    base = 0
    for path in files:
        kind = input_kind(path)
        size = path.stat().st_size
        if kind == ".parquet":
            for fraction, chunk in _parquet_chunks(path, keys, chunk_bytes):
                yield chunk
                tracker.advance_to(base, int(fraction * size))
        else:
            yield from _stream_chunks(path, kind, keys, chunk_bytes, tracker, base)
        base += size
        tracker.advance_to(base, 0)


def _stream_chunks(path: Path, kind: str, keys: list[str], chunk_bytes: int,
                   tracker: _Progress, base: int) -> Iterator[tuple]:
    """The chunks of one (maybe gzipped) JSON Lines, JSON array or text file."""
    with open(path, "rb") as raw:
        stream = gzip.GzipFile(fileobj=raw) if kind.endswith(".gz") else raw
        report = lambda: tracker.advance_to(base, raw.tell())  # noqa: E731
        try:
            if kind.startswith(".jsonl"):
                yield from _line_chunks(path, stream, chunk_bytes, report)
            elif kind.startswith(".json"):
                yield from _json_array_chunks(path, stream, keys, chunk_bytes, report)
            else:
                yield from _text_chunks(path, stream, min(chunk_bytes, TEXT_PIECE_BYTES),
                                        report)
        except (OSError, EOFError, zlib.error) as e:
            raise DataError(f"{path}: cannot read ({one_line(e)})") from None


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


class _JsonArrayCursor:
    """A position in one top-level JSON array read in blocks: ``buf[pos:]`` is the text
    not consumed yet, ``line`` the line ``pos`` is on."""

    def __init__(self, path: Path, stream, chunk_bytes: int, report):
        self.path, self.stream, self.chunk_bytes, self.report = path, stream, chunk_bytes, report
        self.utf8 = codecs.getincrementaldecoder("utf-8")()
        self.decoder = json.JSONDecoder()
        self.buf, self.pos, self.line, self.eof = "", 0, 1, False

    def _error(self, reason: str) -> DataError:
        return DataError(f"{self.path}:{self.line}: {reason}")

    def _more(self) -> bool:
        """Reads one more block into ``buf``; False once the input is exhausted."""
        if self.eof:
            return False
        data = self.stream.read(self.chunk_bytes)
        self.report()
        try:
            text = self.utf8.decode(data, final=not data)
        except UnicodeDecodeError as e:
            bad_line = (self.line + self.buf[self.pos:].count("\n")
                        + e.object[:e.start].count(b"\n"))
            raise DataError(f"{self.path}:{bad_line}: not valid UTF-8 "
                            f"(byte 0x{e.object[e.start]:02x})") from None
        self.eof = not data
        self.buf = self.buf[self.pos:] + text
        self.pos = 0
        return True

    def _skip_space(self) -> bool:
        """Moves past whitespace; False at the end of input."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in " \t\r\n":
                self.line += self.buf[self.pos] == "\n"
                self.pos += 1
            if self.pos < len(self.buf):
                return True
            if not self._more():
                return False

    def open_array(self) -> None:
        if not self._skip_space() or self.buf[self.pos] != "[":
            raise self._error("a .json file must hold one array of objects "
                              "(use .jsonl for one object per line)")
        self.pos += 1

    def next_element(self, first: bool) -> bool:
        """Moves to the start of the next element; False past the closing bracket."""
        if not self._skip_space():
            raise self._error("not valid JSON (the array is not closed)")
        if self.buf[self.pos] == "]":
            self.pos += 1
            if self._skip_space():
                raise self._error("not valid JSON (text after the array)")
            return False
        if not first:
            if self.buf[self.pos] != ",":
                raise self._error("not valid JSON (expected ',' or ']')")
            self.pos += 1
            if not self._skip_space():
                raise self._error("not valid JSON (the array is not closed)")
        return True

    def decode_element(self) -> tuple[int, object, int]:
        """(its line, the element or ``("error", reason)`` if it is no text, its length
        in characters), and moves past it."""
        while True:
            try:
                obj, end = self.decoder.raw_decode(self.buf, self.pos)
                break
            except json.JSONDecodeError as e:
                # Maybe only cut by the read: read on, up to a bound.
                if len(self.buf) - self.pos > _MAX_RECORD_BYTES or not self._more():
                    where = self.line + self.buf[self.pos:e.pos].count("\n")
                    raise DataError(f"{self.path}:{where}: not valid JSON ({e.msg})") from None
            except (RecursionError, ValueError) as e:  # valid JSON Python cannot hold
                raise self._error(unreadable(e)) from None
        try:
            if SURROGATE_ESCAPE.search(self.buf, self.pos, end):
                check_record(obj)
        except BadRecord as e:  # a whole element, but no text: a bad record, not a bad file
            obj = ("error", str(e))
        line, length = self.line, end - self.pos
        self.line += self.buf.count("\n", self.pos, end)
        self.pos = end
        return line, obj, length


def _json_array_chunks(path: Path, stream, keys: list[str], chunk_bytes: int,
                       report) -> Iterator[tuple]:
    """Streams the elements of one top-level JSON array without loading the file."""
    cursor = _JsonArrayCursor(path, stream, chunk_bytes, report)
    cursor.open_array()
    records, size, first = [], 0, True
    while cursor.next_element(first):
        first = False
        line, obj, length = cursor.decode_element()
        records.append((line, _pick(obj, keys)))
        size += length
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
    """(fraction of the file read, chunk) for each batch of about ``chunk_bytes``."""
    try:
        import pyarrow.parquet as pq  # optional dependency, only for parquet inputs
    except ImportError:
        raise DataError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from None
    try:
        pf = pq.ParquetFile(str(path))
    except Exception as e:  # pyarrow raises its own ArrowInvalid etc.
        raise DataError(f"{path}: not a readable parquet file ({one_line(e)})") from None
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
        values = {k: _column_values(batch.column(k), k) for k in keys}
        records = [(row + i, _parquet_record(values, i)) for i in range(batch.num_rows)]
        row += batch.num_rows
        yield (row - 1) / max(meta.num_rows, 1), ("records", str(path), records)


def _column_values(column, key: str) -> list:
    """A parquet column's values; a string that is not UTF-8 (arrow does not check what
    another writer stored) becomes ``("error", reason)``, for that row's file:row."""
    try:
        return column.to_pylist()
    except UnicodeDecodeError:
        values = []
        for item in column:
            try:
                values.append(item.as_py())
            except UnicodeDecodeError as e:
                values.append(("error", f"field {key!r} is not valid UTF-8 (byte "
                                        f"0x{e.object[e.start]:02x} at byte {e.start + 1})"))
        return values


def _parquet_record(values: dict, i: int):
    """Row ``i`` as a record, or the ``("error", reason)`` of its first bad value."""
    bad = next((v[i] for v in values.values() if isinstance(v[i], tuple)), None)
    return bad or {k: v[i] for k, v in values.items()}


# ------------------------------------------------------------------- records (workers)

def parse_lines(block: bytes, first_line: int) -> list:
    """[(line, object)] of a JSON Lines block; a bad line's object is ("error", reason)."""
    items = []
    for i, raw in enumerate(block.split(b"\n")):
        if not raw.strip():
            continue
        try:
            items.append((first_line + i, parse_record(raw)))
        except BadRecord as e:
            items.append((first_line + i, ("error", str(e))))
    return items


def record_texts(obj, keys: list[str]):
    """The texts of a record (one per key), or a reason (a str) why it is bad."""
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


def iter_record_texts(path: Path, keys: list[str], chunk_bytes: int = 1 << 20
                      ) -> Iterator[str]:
    """The texts under ``keys`` of every record of one JSON Lines, JSON array or parquet
    file, in order and in this process (``preprocess`` spreads the same work over its
    workers); a bad record raises ``file:line: reason``."""
    for chunk in iter_chunks([Path(path)], keys, chunk_bytes):
        items = parse_lines(chunk[3], chunk[2]) if chunk[0] == "lines" else chunk[2]
        for line, obj in items:
            texts = record_texts(obj, keys)
            if isinstance(texts, str):
                raise at(path, line, texts)
            yield from texts


def _json_type(value) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
            int: "a number", float: "a number", type(None): "null"}.get(type(value),
                                                                         type(value).__name__)
