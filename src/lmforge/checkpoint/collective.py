"""What every rank must agree on: ``CheckpointError``, one-line descriptions of
failures, and the agreement itself (a rank that failed makes every rank raise)."""
from __future__ import annotations

import errno
import re
import shutil
import warnings
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from lmforge.fsio import torch_load_error

try:  # a BaseException, not an Exception: it must be caught by name
    from torch.distributed.checkpoint.api import CheckpointException as DCPException
except ImportError:  # pragma: no cover
    class DCPException(Exception):
        pass

CAUGHT = (Exception, DCPException)  # what a failed write raises
_DISK_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
# torch.save to a path writes through its zip writer (inline_container.cc), which reports
# a short write on a full disk as an enforce failure, without the errno.
_ZIP_WRITE_FAILED = re.compile(r"\[enforce fail at inline_container\.cc:\d+\]\s*\.?\s*"
                               r"(.*(?:failed writing file|unexpected pos).*)")


class CheckpointError(ValueError):
    """A checkpoint cannot be written, found or read; one line naming the directory."""


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def group_rank(pg) -> int:
    return dist.get_rank(pg) if distributed() else 0


def global_rank() -> int:
    return dist.get_rank() if distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if distributed() else 1


def group_size(pg) -> int:
    return dist.get_world_size(pg) if distributed() else 1


def gather_errors(error: Optional[str], pg) -> list[str]:
    """Every rank's error (None = fine); also a barrier."""
    if not distributed():
        return [error] if error else []
    errors: list = [None] * dist.get_world_size(pg)
    dist.all_gather_object(errors, error, group=pg)
    return [e for e in errors if e]


def agree(error: Optional[str], pg, tmp: Optional[Path] = None) -> None:
    """Raise the same ``CheckpointError`` on every rank when any rank failed (rank 0
    removes the partial directory first)."""
    errors = gather_errors(error, pg)
    if not errors:
        return
    if tmp is not None:
        if group_rank(pg) == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if distributed():
            dist.barrier(group=pg)  # no rank returns while the partial directory exists
    raise CheckpointError(errors[0])


class QuietSingleProcess:
    """DCP warns on every call made without a process group; here one process is meant."""

    def __enter__(self):
        self._ctx = warnings.catch_warnings()
        self._ctx.__enter__()
        if not distributed():
            warnings.filterwarnings("ignore", message=r".*assuming the intent is to .* in a "
                                    r"single process")

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)


def raised_checkpoint_error(err: BaseException) -> Optional[CheckpointError]:
    """The ``CheckpointError`` our own reader or planner raised inside DCP (which wraps
    each rank's failure), so its one line reaches the user unchanged."""
    if isinstance(err, CheckpointError):
        return err
    for wrapped in (getattr(err, "failures", None) or {}).values():
        inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        if isinstance(inner, BaseException):
            return raised_checkpoint_error(inner)
    return None


def describe(err: BaseException) -> str:
    """One line for an exception, digging the first real cause out of DCP's wrapper."""
    if isinstance(err, DCPException):
        failures = getattr(err, "failures", {}) or {}
        for wrapped in failures.values():
            inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
            if isinstance(inner, BaseException):
                return describe(inner)
        return type(err).__name__
    if isinstance(err, OSError) and err.errno in _DISK_FULL:
        return f"disk full ({err.strerror or 'no space left on device'})"
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    text = torch_load_error(err)  # never torch's advice to load with weights_only=False
    zip_write = _ZIP_WRITE_FAILED.search(text)
    if zip_write:
        return f"disk full, or another failed write (torch: {zip_write.group(1)})"
    return text


def write_error(directory: Path, err: BaseException) -> str:
    return f"{directory}: cannot write checkpoint ({describe(err)})"
