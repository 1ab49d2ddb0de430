"""The one lock of a path written by one process at a time (a run directory, a data
cache entry): ``FileLock``, an ``flock`` released when its process dies (even by kill -9),
with the holder (pid, host, start time) written in it so that a refusal names who holds
it and a lock left by a dead process is taken over."""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import stat
import time
from pathlib import Path
from typing import Optional

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
            fd = _open_lock_file(self.path)
            try:
                _refuse_odd_file(os.fstat(fd).st_mode, self.path)  # swapped in meanwhile
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


def _open_lock_file(path: Path) -> int:
    """The lock file, opened for writing its holder: never through a link (its target
    would be overwritten), never a FIFO (waited on) or a device (opened at all)."""
    with contextlib.suppress(FileNotFoundError):
        _refuse_odd_file(os.lstat(path).st_mode, path)
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:  # made a link since the lstat
            _refuse_odd_file(stat.S_IFLNK, path)
        raise


def _refuse_odd_file(mode: int, path: Path) -> None:
    if stat.S_ISLNK(mode):
        raise OSError(errno.ELOOP, "a symbolic link, which a lock file never is", str(path))
    if not stat.S_ISREG(mode):
        raise OSError(errno.EINVAL, "not a regular file, which a lock file always is",
                      str(path))


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
