"""Atomic writes, the one implementation every writer uses (checkpoints, Hugging Face
model directories, adapters, datasets and data caches); and the rules for reading what
others wrote: which file names an index may give, and how a refused ``torch.load`` is
reported.

The scheme: write into a temporary sibling, fsync it, rename it into place, fsync the
parent directory. A reader, or a run after a crash, sees the old content or the new one,
never half of it. A directory that is replaced is first renamed aside
(``.NAME.old-XXXXXXXX``) and a directory that is removed is renamed aside
(``.NAME.deleting-XXXXXXXX``) before it is deleted, so a deletion cut short never leaves
something half-deleted under the real name; ``set_aside_original`` recognises those
leftovers for clean-up at start-up.

``FileLock`` is the one lock of a path written by one process at a time (a run directory,
a dataset prefix): an exclusive ``flock`` on a lock file, released by the kernel when the
process dies (even by kill -9), with the holder (pid, host, start time) written in it so
a refusal can name it. Where the file system has no ``flock`` (some Lustre mounts), the
recorded holder decides: a dead process on this host, or an earlier attempt of the same
SLURM job, is stale; a holder on another host is trusted.
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

from lmforge.fsio.locks import FileLock, LockHeld, describe_holder, holder_alive  # noqa: F401

_SET_ASIDE = re.compile(r"^\.(?P<name>.+)\.(?:old|deleting)-[0-9a-f]{8}$")
_PICKLE_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
_UNPICKLER_DETAIL = re.compile(r"WeightsUnpickler error: (.*?)\s*(?:Check the documentation|$)")


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
        problem = cannot_create_in(directory)
        if problem:
            raise PermissionError(f"{path}: cannot write {what}: {directory} does not "
                                  f"accept new files ({problem})")


# errno -> why, in plain words, a directory refused a new file
_REFUSALS = {errno.EROFS: "the file system is read-only",
             errno.EACCES: "permission denied", errno.EPERM: "permission denied",
             errno.ENOSPC: "no space left on the device",
             errno.EDQUOT: "the disk quota is used up"}


def cannot_create_in(directory: Path) -> Optional[str]:
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
