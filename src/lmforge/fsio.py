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
import fcntl
import json
import os
import re
import shutil
import socket
import time
import uuid
from pathlib import Path
from typing import IO, Iterator, Optional

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


# ------------------------------------------------------------------------------ locks

_NO_FLOCK = {errno.ENOLCK, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP}


class LockHeld(Exception):
    """Another live process holds the lock; ``holder`` is what it recorded (pid, host,
    started), ``{}`` when it cannot be read."""

    def __init__(self, path: Path, holder: dict):
        super().__init__(f"{path}: held by {describe_holder(holder)}")
        self.path, self.holder = path, holder


def describe_holder(holder: dict) -> str:
    """"pid 123 on host, started 2024-..."."""
    return (f"pid {holder.get('pid')} on {holder.get('host')}, started "
            f"{holder.get('started')}")


class FileLock:
    """An exclusive lock on ``path`` from ``acquire`` to ``release`` (see the module doc).

    ``remove``: delete the lock file at release, so a job leaves nothing behind. That is
    safe because ``acquire`` checks, once it holds the flock, that ``path`` is still the
    file it locked: a process that locked a file just deleted by its holder tries again on
    the new one, so two processes never hold locks on two files of one name. Without
    ``remove`` the file stays, its content marked released."""

    def __init__(self, path: str | Path, remove: bool = False):
        self.path, self.remove = Path(path), remove
        self._fd: Optional[int] = None

    def acquire(self) -> None:
        """Take the lock, or raise ``LockHeld`` naming the live process that holds it
        (``OSError`` when the lock file cannot be created)."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                state = _flock(fd)
                holder = _read_holder(fd)
                if state == "taken" or (state == "unsupported" and holder_alive(holder)):
                    raise LockHeld(self.path, holder)
                if not _still_named(fd, self.path):
                    os.close(fd)  # its holder deleted it as we locked it: lock the new one
                    continue
                _write_holder(fd, _this_process())
            except BaseException:
                with contextlib.suppress(OSError):
                    os.close(fd)
                raise
            self._fd = fd
            return

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            if self.remove:
                self.path.unlink(missing_ok=True)  # while we hold it (see the class doc)
            else:
                _write_holder(self._fd, {"released": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
        finally:
            os.close(self._fd)  # closing drops the flock
            self._fd = None

    def __enter__(self) -> "FileLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _flock(fd: int) -> str:
    """"ours" (this process now holds the flock), "taken" (another process does) or
    "unsupported" (the file system cannot flock)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return "ours"
    except BlockingIOError:
        return "taken"
    except OSError as e:
        if e.errno in _NO_FLOCK:
            return "unsupported"
        raise


def _still_named(fd: int, path: Path) -> bool:
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (mine.st_dev, mine.st_ino)


def _read_holder(fd: int) -> dict:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = os.read(fd, 65536)
    try:
        holder = json.loads(raw.decode() or "{}")
    except (UnicodeDecodeError, ValueError):
        return {}  # torn or foreign content: nobody we can name
    return holder if isinstance(holder, dict) else {}


def _write_holder(fd: int, holder: dict) -> None:
    data = (json.dumps(holder, indent=2) + "\n").encode()
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, data)
    os.fsync(fd)


def _this_process() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "process_start": _process_start(os.getpid()),
            "slurm_job": os.environ.get("SLURM_JOB_ID")}


def _process_start(pid: int) -> Optional[str]:
    """The kernel's start time of ``pid`` (Linux), which tells a reused pid apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22, after the command name


def holder_alive(holder: dict) -> bool:
    """Whether the process recorded in a lock file may still be running (used where no
    flock tells us)."""
    if not holder.get("pid") or holder.get("released"):
        return False
    job = os.environ.get("SLURM_JOB_ID")
    if job and holder.get("slurm_job") == job:
        return False  # an earlier attempt of this job: SLURM ended it before requeueing
    if holder.get("host") != socket.gethostname():
        return True  # another host's processes cannot be seen from here
    started = _process_start(int(holder["pid"]))
    if started is None:
        return _pid_exists(int(holder["pid"]))
    return holder.get("process_start") in (None, started)


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
