"""The one error type of the data pipeline."""
from __future__ import annotations


class DataError(ValueError):
    """Bad input data or a bad data setting. The message is one line that names the place
    at fault, ``file:line: reason`` for a record, ``file: reason`` for a whole file."""


def at(path, line: int | None, reason: str) -> DataError:
    """``DataError('path:line: reason')`` (``path: reason`` when the line is unknown)."""
    where = f"{path}:{line}" if line is not None else f"{path}"
    return DataError(f"{where}: {' '.join(str(reason).split())}")
