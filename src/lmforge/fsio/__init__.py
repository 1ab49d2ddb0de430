"""Atomic writes, the one implementation every writer uses (checkpoints, Hugging Face
model directories, adapters, datasets and data caches); and the rules for reading what
others wrote: which file names an index may give, and how a refused ``torch.load`` is
reported.

The scheme: write into a temporary sibling, fsync it, rename it into place, fsync the
parent directory. A reader, or a run after a crash, sees the old content or the new one,
never half of it (``growing_file``: a file of records that grows in place once its first
piece is in, for a writer whose finished part must outlive a kill). A directory that is
replaced is first renamed aside (``.NAME.old-XXXXXXXX``) and a directory that is removed
is renamed aside (``.NAME.deleting-XXXXXXXX``) before it is deleted, so a deletion cut
short never leaves something half-deleted under the real name; ``set_aside_original``
recognises those leftovers for clean-up at start-up.

``FileLock`` is the one lock of a path written by one process at a time (a run directory,
a dataset prefix): an exclusive ``flock`` on a lock file, released by the kernel when the
process dies (even by kill -9), with the holder (pid, host, start time) written in it so
a refusal can name it. Where the file system has no ``flock`` (some Lustre mounts), the
recorded holder decides: a dead process on this host, or an earlier attempt of the same
SLURM job, is stale; a holder on another host is trusted.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import uuid
from pathlib import Path
from typing import IO, Iterator, Optional

from lmforge.fsio.locks import FileLock, LockHeld, describe_holder, holder_alive  # noqa: F401
from lmforge.fsio.outputs import (NotWritable, cannot_create_in, check_apart,  # noqa: F401
                                  check_writable)

_SET_ASIDE = re.compile(r"^\.(?P<name>.+)\.(?:old|deleting)-[0-9a-f]{8}$")
_PICKLE_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
_UNPICKLER_DETAIL = re.compile(r"WeightsUnpickler error: (.*?)\s*(?:Check the documentation|$)")


def tmp_tag() -> str:
    """A suffix for temporary names unique to this process, also across nodes sharing a
    file system."""
    return f".tmp-{socket.gethostname()}-{os.getpid()}"


def tmp_sibling(path: str | Path) -> Path:
    """A fresh hidden name beside ``path`` to build its new content under
    (``.NAME.tmp-HOST-PID-XXXXXXXX``). The stale ones a killed process of this host left
    for the same ``path`` are removed first: a killed export's hundreds of MB are not kept
    for ever, and the next write of the same target is the one that knows their names."""
    path = Path(path)
    remove_stale_temporaries(path)
    return path.with_name(f".{path.name}{tmp_tag()}-{uuid.uuid4().hex[:8]}")


def remove_stale_temporaries(path: str | Path) -> list[Path]:
    """Remove the temporaries of ``path`` (``tmp_sibling``'s ``.NAME.tmp-HOST-PID-XXXXXXXX``
    and the ``NAME.tmp-HOST-PID`` of writers that name theirs with ``tmp_tag``) whose
    process is gone: recorded on this host, with a pid no longer alive (``holder_alive``'s
    rule). Another host's, or a live process's, are never touched: they may be mid-write.
    Returns what was removed."""
    path = Path(path)
    host = socket.gethostname()
    stale = re.compile(rf"^(?:\.{re.escape(path.name)}\.tmp-{re.escape(host)}-(\d+)-"
                       rf"[0-9a-f]{{8}}|{re.escape(path.name)}\.tmp-{re.escape(host)}-(\d+))$")
    removed = []
    try:
        entries = list(os.scandir(path.parent))
    except OSError:
        return removed  # no parent yet (or unreadable): nothing of ours there
    for entry in entries:
        match = stale.match(entry.name)
        if not match or holder_alive({"pid": int(match.group(1) or match.group(2)),
                                      "host": host}):
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
        removed.append(Path(entry.path))
    return removed


# ------------------------------------------------------------------------------ files

def fsync_path(path: str | Path) -> None:
    """Flush a file, or a directory's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: str | Path, data: bytes) -> None:
    """Write and fsync ``path`` in place: for files inside a directory that is itself
    committed atomically (use ``atomic_write_bytes`` for a file on its own)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def replace_file(tmp: str | Path, path: str | Path) -> None:
    """Move a finished temporary file into place, durably."""
    fsync_path(tmp)
    os.replace(tmp, path)
    fsync_path(Path(path).parent)


@contextlib.contextmanager
def atomic_file(path: str | Path) -> Iterator[IO[bytes]]:
    """``with atomic_file(p) as f: f.write(...)``: ``p`` appears, complete, when the block
    ends; an exception leaves ``p`` as it was and removes the temporary file."""
    tmp = tmp_sibling(path)
    try:
        with open(tmp, "xb") as f:
            yield f
        replace_file(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_file(path) as f:
        f.write(data)


class GrowingFile:
    """A file written piece by piece (records as they are made) that a kill never takes
    back: the first piece is written under a temporary name (``tmp_sibling``), fsynced
    and renamed over ``path``, so a failure before it leaves ``path`` as it was; every
    later piece is appended to ``path`` itself and fsynced before ``append`` returns.
    Use ``growing_file``."""

    def __init__(self, path: str | Path):
        self.path, self.tmp = Path(path), tmp_sibling(path)
        self.file = open(self.tmp, "xb")
        self.placed = False

    def append(self, data: bytes) -> None:
        self.file.write(data)
        self.file.flush()
        os.fsync(self.file.fileno())
        if not self.placed:  # (the open file follows the rename: later pieces land there)
            os.replace(self.tmp, self.path)
            fsync_path(self.path.parent)
            self.placed = True

    def close(self) -> None:
        self.file.close()
        if not self.placed:
            self.tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def growing_file(path: str | Path) -> Iterator[GrowingFile]:
    """``with growing_file(p) as out: out.append(piece)``: ``p`` holds the pieces appended
    so far, whatever ends the block (``GrowingFile``); nothing appended, it is untouched."""
    out = GrowingFile(path)
    try:
        yield out
    finally:
        out.close()


# ------------------------------------------------------------------------ directories

@contextlib.contextmanager
def parent_dirs(path: str | Path) -> Iterator[None]:
    """Creates the missing directories above ``path``; if the block raises, removes those
    of them still empty, so a refused job leaves nothing behind."""
    missing, parent = [], Path(path).parent
    while not parent.exists() and parent != parent.parent:
        missing.append(parent)  # deepest first
        parent = parent.parent
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    try:
        yield
    except BaseException:
        for directory in missing:
            with contextlib.suppress(OSError):
                directory.rmdir()
        raise


def set_aside(path: Path, why: str) -> Path:
    """Rename ``path`` to a hidden sibling (``why``: old or deleting); returns it."""
    aside = path.with_name(f".{path.name}.{why}-{uuid.uuid4().hex[:8]}")
    os.replace(path, aside)
    return aside


def set_aside_original(name: str) -> Optional[str]:
    """The name a ``set_aside`` leftover was renamed from, None for any other name."""
    match = _SET_ASIDE.match(name)
    return match.group("name") if match else None


def replace_dir(tmp: Path, path: Path) -> None:
    """Swap a finished temporary directory into place: two renames, so a reader sees the
    old directory or the new one, never a partial one. The caller has fsynced ``tmp``'s
    files; the renames are made durable here."""
    old = set_aside(path, "old") if path.exists() else None
    os.replace(tmp, path)
    fsync_path(path.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def temporary_dir(beside: str | Path) -> Iterator[Path]:
    """A scratch directory named like ``beside``'s temporaries (``tmp_sibling``), removed
    when the block ends: for a writer that builds an intermediate (a Hugging Face export
    on the way to one GGUF file) on the output's file system. A kill leaves it under a
    name the next write of ``beside`` recognises and removes."""
    tmp = tmp_sibling(beside)
    tmp.mkdir()
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def remove_dir(path: Path) -> None:
    """Delete a directory; it stops existing under its name at once (one rename)."""
    shutil.rmtree(set_aside(path, "deleting"), ignore_errors=True)


def fsync_tree(root: Path) -> None:
    """fsync every file under ``root`` and every directory's entries."""
    for directory, _, files in os.walk(root):
        for name in files:
            fsync_path(Path(directory, name))
        fsync_path(directory)


@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """``with atomic_dir(out) as tmp:`` write the files into ``tmp``; when the block ends
    they replace ``out`` as a whole. An exception removes ``tmp`` and leaves ``out`` as it
    was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_sibling(path)
    tmp.mkdir()
    try:
        yield tmp
        fsync_tree(tmp)
        replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# ------------------------------------------------------------- reading what others wrote

def is_plain_name(name: object) -> bool:
    """A file name inside a directory: a string with no separator, not ``.``/``..``, not
    absolute. The only names an index, a manifest or a metadata file may give."""
    return isinstance(name, str) and Path(name).name == name and name not in ("", ".", "..")


def outside_dir(root: str | Path, name: object) -> Optional[str]:
    """Why ``name`` (read from a file in ``root``) must not be opened, or None when it is a
    plain name whose file, symlinks followed, lies inside ``root``. One place outside
    counts as inside: the ``blobs/`` of a Hugging Face hub cache repository, which its
    ``snapshots/<revision>/`` files link to."""
    if not is_plain_name(name):
        return "not a plain file name inside the directory"
    home = Path(root).resolve()
    allowed = [home] + ([home.parent.parent / "blobs"] if home.parent.name == "snapshots"
                        else [])
    target = (home / name).resolve()
    if not any(target.is_relative_to(place) for place in allowed):
        return f"a link to {target}, outside the directory"
    return None


def torch_load_error(err: BaseException) -> str:
    """One line for what ``torch.load(weights_only=True)`` raised. torch's own message
    advises retrying with ``weights_only=False``, which runs whatever the file asks for:
    that advice is never passed on; the global the pickle asked for is."""
    text = " ".join(str(err).split())
    if "Weights only load failed" not in text:
        return text or type(err).__name__
    asked = _PICKLE_GLOBAL.search(text)
    if asked:
        return f"refused: the pickle asks for {asked.group(1)}, which a weights-only load " \
               f"never runs"
    detail = _UNPICKLER_DETAIL.search(text)
    return "refused: a pickle a weights-only load cannot read" + (
        f" ({detail.group(1)})" if detail and detail.group(1) else "")
