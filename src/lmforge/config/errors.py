"""The one error a config refusal raises (every layer above raises it too), and ``show``,
which every message that quotes a user's value goes through."""
from __future__ import annotations

import contextlib
import reprlib
import sys
from pathlib import Path
from typing import Any, Iterator

SHOW_LIMIT = 80  # characters of a value a message quotes


class ConfigError(ValueError):
    """A config value is wrong; the message starts with the dotted field name."""


class _Short(reprlib.Repr):
    """reprlib's repr with a few items per level, and a long int named by its size."""

    def __init__(self, limit: int):
        super().__init__()
        self.maxlevel, self.maxstring, self.maxother = 3, limit, limit
        self.maxlist = self.maxtuple = self.maxdict = self.maxset = 4

    def repr_int(self, x: int, level: int) -> str:
        try:
            text = repr(x)
        except ValueError:  # over Python's int-to-str limit (4300 digits): a user's code
            return f"an integer of more than {sys.get_int_max_str_digits()} digits"
        return text if len(text) <= self.maxother else f"an integer of {len(text)} digits"


def show(value: Any, limit: int = SHOW_LIMIT) -> str:
    """``repr(value)`` cut to about ``limit`` characters, on one line, whatever the value's
    size: a message may quote what a user wrote, never all of it (a YAML alias bomb's list
    is gigabytes of repr)."""
    text = _Short(limit).repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def show_name(name: str, limit: int = SHOW_LIMIT) -> str:
    """A key or a path as a message names it (no quotes), cut to ``limit`` characters."""
    name = " ".join(str(name).split()) if "\n" in str(name) else str(name)
    return name if len(name) <= limit else name[:limit - 3] + "..."


@contextlib.contextmanager
def naming(temporary: str | Path, source: str | Path) -> Iterator[None]:
    """Errors raised inside the block name ``source`` where they would name
    ``temporary``: a copy the command made of it (a checkpoint exported to HF for a GGUF
    conversion), whose path means nothing to the user and is gone once the line prints."""
    try:
        yield
    except (ValueError, OSError) as e:
        text = str(e)
        if str(temporary) not in text:
            raise
        try:
            renamed = type(e)(text.replace(str(temporary), str(source)))
        except Exception:  # an error type built from other arguments: left as it is
            raise e from None
        raise renamed from None
