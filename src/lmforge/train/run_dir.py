"""A run directory has one owner.

A run holds ``train.output_dir/lmforge.lock`` from start to end: an exclusive ``flock``
on the file (released by the kernel when the process dies, even by kill -9), and in it
who holds it (pid, host, start time). A second run on the same directory is refused,
naming the holder; a lock left by a dead run is taken over. Where the file system has no
``flock`` (some Lustre mounts), the pid and host decide: a dead process on this host, or
an earlier attempt of the same SLURM job, is stale; a holder on another host is trusted.

A fresh run (no ``train.resume``) in a directory that holds checkpoints is refused unless
``train.overwrite=true`` (start over: the earlier run's outputs are removed) or
``train.resume=auto`` (continue it): otherwise retention would prune one run's
checkpoints in favour of the other's, and a later ``resume=auto`` would continue the
wrong run.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Optional

from lmforge import fsio
from lmforge.checkpoint import latest_checkpoint
from lmforge.config import ConfigError, JobConfig
from lmforge.perf.records import METRICS_FILE

LOCK_NAME = "lmforge.lock"
CHECKPOINTS = "checkpoints"  # the run's checkpoints root, inside the run directory
# What an earlier run left that a fresh run with train.overwrite=true removes. The data
# cache stays: its entries are keyed by what they were built from.
RUN_OUTPUTS = (CHECKPOINTS, "hf", "adapter", "tensorboard", METRICS_FILE, "summary.json")
_NO_FLOCK = {errno.ENOLCK, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP}


class RunLock:
    """``lmforge.lock`` in a run directory, held from ``acquire`` to ``release``."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / LOCK_NAME
        self._fd: Optional[int] = None

    def acquire(self) -> None:
        """Take the lock, or raise ``ConfigError`` naming the live run that holds it."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            state = _flock(fd)
            holder = _read_holder(fd)
            if state == "taken" or (state == "unsupported" and holder_alive(holder)):
                raise ConfigError(self._in_use(holder))
            _write_holder(fd, _this_process())
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def release(self) -> None:
        """Mark the lock released and let it go. The file stays: deleting it could let two
        later runs lock two different files under one name."""
        if self._fd is None:
            return
        try:
            _write_holder(self._fd, {"released": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
        finally:
            os.close(self._fd)  # closing drops the flock
            self._fd = None

    def _in_use(self, holder: dict) -> str:
        return (f"train.output_dir: {self.path.parent} is in use by another run (pid "
                f"{holder.get('pid')} on {holder.get('host')}, started "
                f"{holder.get('started')}; lock file {self.path}). Wait for it to end or "
                f"choose another train.output_dir")


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
    """Whether the run recorded in a lock file may still be running (used where no flock
    tells us)."""
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


# ------------------------------------------------------------------ claiming a run dir

def claim_run_dir(cfg: JobConfig, run_dir: Path) -> RunLock:
    """Rank 0, before anything is written there: lock ``run_dir`` and apply the fresh-run
    rule. Returns the held lock; raises ``ConfigError`` with one line otherwise."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock = RunLock(run_dir)
        lock.acquire()
    except OSError as e:
        raise ConfigError(f"train.output_dir: cannot write to {run_dir} "
                          f"({e.strerror or e})") from None
    try:
        _fresh_run_rule(cfg, run_dir)
    except BaseException:
        lock.release()
        raise
    return lock


def _fresh_run_rule(cfg: JobConfig, run_dir: Path) -> None:
    if cfg.train.resume:
        return
    if cfg.train.overwrite:
        remove_run_outputs(run_dir)
        return
    newest = latest_checkpoint(run_dir / CHECKPOINTS)
    if newest is not None:
        raise ConfigError(
            f"train.output_dir: {run_dir} holds checkpoints of an earlier run (newest "
            f"{newest.name}); continue it with train.resume=auto, start over with "
            f"train.overwrite=true (deletes them), or choose another train.output_dir")


def remove_run_outputs(run_dir: Path) -> list[str]:
    """What an earlier run wrote in ``run_dir`` (``RUN_OUTPUTS``), removed; returns the
    names removed."""
    removed = []
    for name in RUN_OUTPUTS:
        path = run_dir / name
        if path.is_dir():
            fsio.remove_dir(path)
        elif path.exists():
            path.unlink()
        else:
            continue
        removed.append(name)
    return removed
