"""One JSON record as every reader of lmforge reads it: ``parse_record`` (a line of JSON
Lines) and ``check_record`` (any record, whatever file format it came from), and
``iter_jsonl``, the JSON Lines reader of SFT, preference and eval data.

JSON that ``json.loads`` accepts but that is no text to train on is a bad record, refused
with ``file:line`` like a syntax error (``BadRecord`` carries the reason, the caller the
place): a lone UTF-16 surrogate (``"\\ud800"``: valid JSON, not valid Unicode; no UTF-8
encoder and no tokenizer takes it) in any value or key of the record, read or not;
nesting deeper than Python's JSON reader goes; an integer longer than Python converts.
"""
from __future__ import annotations

import gzip
import json
import re
import zlib
from pathlib import Path
from typing import Iterator

from lmforge.data.errors import DataError, at


def one_line(err: BaseException) -> str:
    """An exception's message on one line (its type's name when it has none)."""
    text = " ".join(str(err).split())
    return text or type(err).__name__


class BadRecord(ValueError):
    """Why one record cannot be read (the caller adds ``file:line``)."""


_SURROGATE = re.compile("[\ud800-\udfff]")
# Decoded UTF-8 never holds a surrogate: one can only come from a \u escape.
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_NAME_CHARS = 40  # a key longer than this is shortened in messages


def parse_record(raw: bytes | str) -> object:
    """One JSON text (a line of JSON Lines) as a checked record (``check_record``);
    ``BadRecord(reason)`` if it is not UTF-8, not JSON, or not readable as text."""
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise BadRecord(f"not valid UTF-8 (byte 0x{e.object[e.start]:02x} at column "
                            f"{e.start + 1})") from None
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        raise BadRecord(f"not valid JSON ({e.msg}, column {e.colno})") from None
    except (RecursionError, ValueError) as e:
        raise BadRecord(unreadable(e)) from None
    if SURROGATE_ESCAPE.search(raw):
        check_record(obj)
    return obj


def unreadable(e: Exception) -> str:
    """Valid JSON that Python's reader refuses (it raises no JSONDecodeError for it)."""
    if isinstance(e, RecursionError):
        return "unreadable JSON (nested too deeply for Python's JSON reader)"
    digits = re.search(r"\((\d+) digits\)", str(e))
    if digits:
        return f"unreadable JSON (an integer of more than {digits[1]} digits)"
    return f"unreadable JSON ({one_line(e)})"


def check_record(obj) -> None:
    """Refuses (``BadRecord``) a record with a lone surrogate in any string, value or key:
    valid JSON, but no Unicode text (it cannot be encoded, so a tokenizer fails on it).
    The reason names the first such field as jq writes its path (``messages[1].content``,
    lists counted from 0). Iterative: a record may nest as deeply as json.loads allows."""
    stack = [("", obj)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            found = _SURROGATE.search(value)
            if found:
                what = f"field {_name(path)!r}" if path else "the record"
                raise BadRecord(f"{what} holds a lone surrogate (\\u{ord(found[0]):04x}), "
                                f"which is not valid Unicode text")
        elif isinstance(value, dict):
            children = []
            for key, item in value.items():
                if _SURROGATE.search(key):
                    raise BadRecord(f"the key {_name(key)!a} holds a lone surrogate, "
                                    f"which is not valid Unicode text")
                children.append((f"{path}.{key}" if path else key, item))
            stack.extend(reversed(children))  # the first field is looked at first
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in reversed(list(enumerate(value))))


def _name(text: str) -> str:
    return text if len(text) <= _NAME_CHARS else text[:_NAME_CHARS] + "..."




def iter_jsonl(path: Path) -> Iterator[tuple[int, object]]:
    """(line number, record) for each non-blank line of a (maybe gzipped) JSON Lines
    file, read in this process; a bad line (``parse_record``) raises ``file:line: reason``,
    a file that cannot be read ``file: cannot read (...)``."""
    opener = gzip.open if str(path).endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            for n, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                try:
                    record = parse_record(raw)
                except BadRecord as e:
                    raise at(path, n, str(e)) from None
                yield n, record
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:  # a cut or broken .gz
        raise DataError(f"{path}: cannot read ({one_line(e)})") from None


def check_argument_text(value: str, option: str) -> None:
    """Refuses a command-line text that is not UTF-8: Python hands its bytes on as lone
    surrogates (surrogateescape), which no tokenizer takes."""
    found = _SURROGATE.search(value)
    if found:
        code = ord(found[0])
        what = f"byte 0x{code - 0xdc00:02x}" if 0xdc80 <= code <= 0xdcff else f"\\u{code:04x}"
        raise DataError(f"{option}: not valid UTF-8 text ({what} at character "
                        f"{found.start() + 1})")
