"""A run directory has one owner.

A run holds ``train.output_dir/lmforge.lock`` from start to end (``fsio.FileLock``: an
exclusive ``flock`` released by the kernel when the process dies, with the holder's pid,
host and start time in the file). A second run on the same directory is refused, naming
the holder; a lock left by a dead run is taken over.

A fresh run (no ``train.resume``) in a directory that holds checkpoints is refused unless
``train.overwrite=true`` (start over: the earlier run's outputs are removed) or
``train.resume=auto`` (continue it): otherwise retention would prune one run's
checkpoints in favour of the other's, and a later ``resume=auto`` would continue the
wrong run.
"""
from __future__ import annotations

from pathlib import Path

from lmforge import fsio
from lmforge.checkpoint import latest_checkpoint
from lmforge.config import ConfigError, JobConfig
from lmforge.perf.records import METRICS_FILE

LOCK_NAME = "lmforge.lock"
CHECKPOINTS = "checkpoints"  # the run's checkpoints root, inside the run directory
# What an earlier run left that a fresh run with train.overwrite=true removes. The data
# cache stays: its entries are keyed by what they were built from.
RUN_OUTPUTS = (CHECKPOINTS, "hf", "adapter", "tensorboard", METRICS_FILE, "summary.json",
               "reference",  # a preference run's precomputed log-probabilities
               "report", "wandb", "trackers.json")  # what the trackers were given


class RunLock(fsio.FileLock):
    """``lmforge.lock`` in a run directory, held from ``acquire`` to ``release`` (the
    lock of ``fsio.FileLock``). The file stays: the directory is the run's anyway."""

    def __init__(self, run_dir: str | Path):
        super().__init__(Path(run_dir) / LOCK_NAME)

    def acquire(self) -> None:
        """Take the lock, or raise ``ConfigError`` naming the live run that holds it."""
        try:
            super().acquire()
        except fsio.LockHeld as e:
            raise ConfigError(
                f"train.output_dir: {self.path.parent} is in use by another run "
                f"({fsio.describe_holder(e.holder)}; lock file {self.path}). Wait for it "
                f"to end or choose another train.output_dir") from None


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
