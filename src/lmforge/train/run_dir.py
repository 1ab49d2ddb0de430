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

A refused run leaves the directory as it found it. The claim records what was there;
until the run starts (``RunClaim.start``: past every check and set-up step, where
``config.yaml`` is written) a refusal undoes the claim (``RunClaim.undo``): what set-up
added is removed, the lock file is as it was (gone, when the claim made it), a directory
the claim created is removed, and the outputs ``train.overwrite`` set aside come back.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional

from lmforge import fsio
from lmforge.checkpoint import clean_stale_tmp, latest_checkpoint
from lmforge.config import ConfigError, JobConfig, save_config
from lmforge.perf.records import METRICS_FILE

LOCK_NAME = "lmforge.lock"
CHECKPOINTS = "checkpoints"  # the run's checkpoints root, inside the run directory
# What an earlier run left that a fresh run with train.overwrite=true removes. The data
# cache stays: its entries are keyed by what they were built from.
RUN_OUTPUTS = (CHECKPOINTS, "hf", "adapter", "tensorboard", METRICS_FILE, "summary.json",
               "reference",  # a preference run's precomputed log-probabilities
               "report", "wandb", "trackers.json")  # what the trackers were given
TOKENIZER_DIR = "tokenizer"  # the one a run without a model's tokenizer trains
CONFIG_FILE = "config.yaml"  # the run's resolved config, written when the run starts
# What set-up never writes into: not walked when the claim records the directory.
_NOT_WALKED = {CHECKPOINTS, "hf", "adapter", "report", "wandb"}


class RunLock(fsio.FileLock):
    """``lmforge.lock`` in a run directory, held from ``acquire`` to ``release`` (the
    lock of ``fsio.FileLock``). The file stays: the directory is the run's anyway."""

    def __init__(self, run_dir: str | Path):
        super().__init__(Path(run_dir) / LOCK_NAME)
        self._found: Optional[bytes] = None  # the file's content before (a refusal restores)
        self._existed = False

    def acquire(self) -> None:
        """Take the lock, or raise ``ConfigError`` naming the live run that holds it."""
        self._existed = os.path.lexists(self.path)
        self._found = self.path.read_bytes() if self.path.is_file() else None
        try:
            super().acquire()
        except fsio.LockHeld as e:
            raise ConfigError(
                f"train.output_dir: {self.path.parent} is in use by another run "
                f"({fsio.describe_holder(e.holder)}; lock file {self.path}). Wait for it "
                f"to end or choose another train.output_dir") from None

    def release(self, undo: bool = False) -> None:
        """``undo``: a refused run leaves the file as it found it (removed where the
        run created it: safe while held, see ``fsio.FileLock``)."""
        if undo and self._fd is not None:
            if not self._existed:
                self.remove = True
            elif self._found is not None:
                os.ftruncate(self._fd, 0)
                os.pwrite(self._fd, self._found, 0)
                os.close(self._fd)  # (drops the flock)
                self._fd = None
                return
        super().release()


# ------------------------------------------------------------------ claiming a run dir

class RunClaim:
    """Rank 0's hold on the run directory (``claim_run_dir``): its lock, and what the
    directory held before, so that a refusal before the run starts leaves it as it was."""

    def __init__(self, run_dir: Path, lock: RunLock, created: Optional[Path]):
        self.run_dir, self.lock, self.created = run_dir, lock, created
        self.entries = _entries(run_dir)
        self.set_aside: dict[str, Path] = {}  # train.overwrite: name -> its hidden copy
        self.started = False

    def start(self, cfg: JobConfig) -> None:
        """The run is past its checks and its set-up: ``config.yaml`` is written and what
        ``train.overwrite`` set aside is deleted."""
        save_config(cfg, self.run_dir / CONFIG_FILE)
        self.started = True
        clean_stale_tmp(self.run_dir / CHECKPOINTS)  # what crashed saves left, before any
        self.set_aside = {}
        for entry in self.run_dir.iterdir():  # also what a killed overwrite left aside
            if fsio.set_aside_original(entry.name) in (*RUN_OUTPUTS, TOKENIZER_DIR):
                _remove(entry)

    def undo(self) -> None:
        """A refusal before ``start``: the directory as the claim found it (see the
        module doc); the lock is released."""
        if self.created is not None:
            self.lock.release(undo=True)
            shutil.rmtree(self.created, ignore_errors=True)
            return
        kept = {LOCK_NAME, *(aside.name for aside in self.set_aside.values())}
        for rel in sorted(_entries(self.run_dir) - self.entries, key=len):
            if Path(rel).parts[0] not in kept:
                _remove(self.run_dir / rel)  # (gone already where a parent was removed)
        for name, aside in self.set_aside.items():
            _remove(self.run_dir / name)  # what set-up wrote under an output's name
            os.replace(aside, self.run_dir / name)
        self.set_aside = {}
        self.lock.release(undo=True)

    def release(self) -> None:
        self.lock.release()


def claim_run_dir(cfg: JobConfig, run_dir: Path) -> RunClaim:
    """Rank 0, before anything is written there: lock ``run_dir`` and apply the fresh-run
    rule. Returns the claim; raises ``ConfigError`` with one line otherwise, leaving the
    directory as it was."""
    try:  # a device, FIFO or socket in it would be written into, or block the run
        fsio.check_writable(run_dir, "train.output_dir", kind="dir")
    except (OSError, ValueError) as e:
        raise ConfigError(str(e)) from None
    created = _outermost_missing(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock = RunLock(run_dir)
        lock.acquire()
    except (OSError, ConfigError) as e:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"train.output_dir: cannot write to {run_dir} "
                          f"({e.strerror or e})") from None
    claim = RunClaim(run_dir, lock, created)
    try:
        _fresh_run_rule(cfg, claim)
    except BaseException as e:
        claim.undo()
        if isinstance(e, OSError):
            raise ConfigError(f"train.overwrite: cannot set {run_dir}'s earlier outputs "
                              f"aside ({e.strerror or e})") from None
        raise
    return claim


def _fresh_run_rule(cfg: JobConfig, claim: RunClaim) -> None:
    run_dir = claim.run_dir
    if cfg.train.resume:
        return
    if cfg.train.overwrite:
        claim.set_aside = set_aside_run_outputs(run_dir)
        return
    newest = latest_checkpoint(run_dir / CHECKPOINTS)
    if newest is not None:
        raise ConfigError(
            f"train.output_dir: {run_dir} holds checkpoints of an earlier run (newest "
            f"{newest.name}); continue it with train.resume=auto, start over with "
            f"train.overwrite=true (deletes them), or choose another train.output_dir")


def set_aside_run_outputs(run_dir: Path) -> dict[str, Path]:
    """``train.overwrite``: what an earlier run wrote (``RUN_OUTPUTS``) renamed to hidden
    names (deleted once the run starts, put back if it is refused before)."""
    return {name: fsio.set_aside(run_dir / name, "deleting")
            for name in RUN_OUTPUTS if os.path.lexists(run_dir / name)}


def _outermost_missing(path: Path) -> Optional[Path]:
    """The outermost directory of ``path`` that does not exist yet (None: it exists)."""
    missing = None
    for candidate in [path, *path.parents]:
        if os.path.lexists(candidate):
            break
        missing = candidate
    return missing


def _entries(run_dir: Path) -> frozenset:
    """Every path under ``run_dir`` (relative), but inside what set-up never writes."""
    found = set()
    for dirpath, dirnames, filenames in os.walk(run_dir):
        rel = Path(dirpath).relative_to(run_dir)
        if rel.parts and rel.parts[0] in _NOT_WALKED:
            dirnames[:] = []
        found.update(str(rel / name) for name in dirnames + filenames)
    return frozenset(found)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        path.unlink()


def resumed_tokenizer(cfg: JobConfig) -> Optional[Path]:
    """The tokenizer a resumed run trained on its corpus and reuses (None: the run has
    none yet, or takes the model's)."""
    saved = Path(cfg.train.output_dir) / TOKENIZER_DIR
    if cfg.model.tokenizer or cfg.model.init_from or not cfg.train.resume:
        return None
    return saved if (saved / "tokenizer.json").is_file() else None
