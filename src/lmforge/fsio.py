"""Atomic writes, the one implementation every writer uses (checkpoints, Hugging Face
model directories, adapters, datasets and data caches).

The scheme: write into a temporary sibling, fsync it, rename it into place, fsync the
parent directory. A reader, or a run after a crash, sees the old content or the new one,
never half of it. A directory that is replaced is first renamed aside
(``.NAME.old-XXXXXXXX``) and a directory that is removed is renamed aside
(``.NAME.deleting-XXXXXXXX``) before it is deleted, so a deletion cut short never leaves
something half-deleted under the real name; ``set_aside_original`` recognises those
leftovers for clean-up at start-up.
"""
from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import socket
import uuid
from pathlib import Path
from typing import IO, Iterator, Optional

_SET_ASIDE = re.compile(r"^\.(?P<name>.+)\.(?:old|deleting)-[0-9a-f]{8}$")


def tmp_tag() -> str:
    """A suffix for temporary names unique to this process, also across nodes sharing a
    file system."""
    return f".tmp-{socket.gethostname()}-{os.getpid()}"


def tmp_sibling(path: str | Path) -> Path:
    """A fresh hidden name beside ``path`` to build its new content under."""
    path = Path(path)
    return path.with_name(f".{path.name}{tmp_tag()}-{uuid.uuid4().hex[:8]}")


# ------------------------------------------------------------------------ destinations

def check_writable(path: str | Path, what: str, kind: str = "file") -> None:
    """Refuse, before any work, an output ``path`` (a ``kind`` "file" or "dir") that could
    not be written: the wrong kind of thing in the way, no permission, or a directory that
    takes no new files. Every writer here creates or renames entries in the parent, so the
    nearest existing ancestor must be a writable directory; a file is created there and
    removed to prove it (permission bits do not tell: root passes them, and /proc, /sys
    or a read-only mount refuse files whatever they say). ``what`` names the option in
    the message."""
    path = Path(path)
    if kind not in ("file", "dir"):
        raise ValueError(f"kind must be file or dir, got {kind!r}")
    if kind == "file" and path.is_dir():
        raise IsADirectoryError(f"{path}: {what} is a file to write, but a directory is "
                                f"in the way")
    if kind == "dir" and path.exists() and not path.is_dir():
        raise NotADirectoryError(f"{path}: {what} is a directory to write, but a file is "
                                 f"in the way")
    if path.exists() and not os.access(path, os.W_OK | (os.X_OK if kind == "dir" else 0)):
        raise PermissionError(f"{path}: {what} is not writable (permission denied)")
    parent = _nearest_existing(path.parent)
    if not parent.is_dir():
        raise NotADirectoryError(f"{path}: cannot write {what}: {parent} is a file, not a "
                                 f"directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"{path}: cannot write {what}: no permission to create "
                              f"files in {parent}")
    # An existing output directory is filled in place by some writers, so it is tried too.
    for directory in (parent, *([path] if kind == "dir" and path.is_dir() else [])):
        problem = _cannot_create_in(directory)
        if problem:
            raise PermissionError(f"{path}: cannot write {what}: {directory} does not "
                                  f"accept new files ({problem})")


# errno -> why, in plain words, a directory refused a new file
_REFUSALS = {errno.EROFS: "the file system is read-only",
             errno.EACCES: "permission denied", errno.EPERM: "permission denied",
             errno.ENOSPC: "no space left on the device",
             errno.EDQUOT: "the disk quota is used up"}


def _cannot_create_in(directory: Path) -> Optional[str]:
    """Why a file cannot be created in ``directory`` (None: it can): one is created and
    removed at once."""
    probe = directory / f".lmforge-probe{tmp_tag()}-{uuid.uuid4().hex[:8]}"
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except OSError as e:
        return _REFUSALS.get(e.errno, f"creating a file there failed: {e.strerror or e}")
    os.unlink(probe)
    return None


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


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
    tmp = Path(f"{path}{tmp_tag()}")
    try:
        with open(tmp, "wb") as f:
            yield f
        replace_file(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_file(path) as f:
        f.write(data)


# ------------------------------------------------------------------------ directories

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
