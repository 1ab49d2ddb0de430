"""Where checkpoints live and when they count: ``ROOT/step-NNNNNNN/`` names, the
``COMPLETE`` marker, discovery (list, latest, ``train.resume``), the atomic commit of a
step directory and retention (pruning, clean-up of what crashed saves left).

A save writes into ``step-NNNNNNN.tmp/``; the commit writes the marker and renames the
directory. Only directories named ``step-N`` that hold the marker are ever listed or
loaded, so a crash mid-write leaves nothing that looks like a checkpoint, and old
checkpoints are pruned only after a new one is committed.
"""
from __future__ import annotations

import json
import re
import shutil
import sys
import warnings
from pathlib import Path
from typing import Optional

from lmforge import fsio
from lmforge.checkpoint.collective import (CAUGHT, CheckpointError, describe, global_rank,
                                           write_error)
from lmforge.checkpoint.integrity import has_checksums, verify_checkpoint

MARKER = "COMPLETE"
EXTRA_NAME = "extra.json"  # global state, identical on all ranks
META_NAME = "meta.json"  # step, world size, model architecture
CONFIG_NAME = "config.yaml"  # the resolved job config
_STEP_DIR = re.compile(r"^step-(\d{7,})$")
_TMP_SUFFIX = ".tmp"
_NAMED = 3  # checkpoints whose problem the "none verifies" error names


def checkpoint_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:07d}"


def rank_file(ckpt_dir: Path, rank: int) -> Path:
    """This rank's own state (RNG) inside a checkpoint."""
    return ckpt_dir / f"rank-{rank:05d}.pt"


def tmp_dir(final: Path) -> Path:
    """Where every rank writes a checkpoint before it is committed as ``final``."""
    return final.with_name(final.name + _TMP_SUFFIX)


def checkpoint_step(path: str | Path) -> int:
    match = _STEP_DIR.match(Path(path).name)
    if not match:
        raise CheckpointError(f"{path}: not a checkpoint directory (expected step-NNNNNNN)")
    return int(match.group(1))


def is_complete(path: str | Path) -> bool:
    path = Path(path)
    return bool(_STEP_DIR.match(path.name)) and (path / MARKER).is_file()


def _looks_uncommitted(path: Path) -> bool:
    """A save that has not finished (or was cut short): ``step-N.tmp`` or ``step-N``
    without the marker."""
    return path.is_dir() and (path.name.endswith(_TMP_SUFFIX) or bool(_STEP_DIR.match(path.name)))


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first. ``.tmp`` directories and ones
    without the marker are never listed."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and is_complete(p)]
    return sorted(found, key=checkpoint_step)


def latest_checkpoint(root: str | Path) -> Optional[Path]:
    found = list_checkpoints(root)
    return found[-1] if found else None


def resume_is_auto(resume: Optional[str]) -> bool:
    """``train.resume=auto``: the newest checkpoint that verifies, found at start-up."""
    return str(resume).strip().lower() == "auto"


def resolve_resume(resume: Optional[str], root: str | Path, *, verify: bool = True,
                   process_group=None) -> Optional[Path]:
    """``train.resume``: None/"" -> None; ``auto`` -> the newest complete checkpoint under
    ``root`` that verifies (None when there is none; the ones skipped are warned about);
    a path -> that checkpoint, which must be complete and verify. ``verify`` checks the
    recorded checksums and that every shard is there (collective when distributed: the
    ranks share the hashing)."""
    if resume is None or str(resume).strip() == "":
        return None
    if resume_is_auto(resume):
        return _newest_verified(root, verify, process_group)
    path = Path(resume)
    if not is_complete(path):
        raise CheckpointError(f"train.resume: {path}: {_why_not_a_checkpoint(path)}")
    problem = _verify(path, verify, process_group)
    if problem:
        raise CheckpointError(f"train.resume: {path}: {problem}")
    return path


def _newest_verified(root: str | Path, verify: bool, process_group) -> Optional[Path]:
    """The newest checkpoint that verifies; those skipped are named in one plain line
    each, or, when none verifies, in the error."""
    found, skipped = list_checkpoints(root), []
    for path in reversed(found):
        problem = _verify(path, verify, process_group)
        if not problem:
            for earlier, why in skipped:
                _say(f"train.resume=auto: skipping {earlier}: {why}")
            return path
        skipped.append((path, problem))
    if found:
        causes = "; ".join(f"{path.name}: {why}" for path, why in skipped[:_NAMED])
        raise CheckpointError(f"train.resume=auto: none of the {len(found)} checkpoints "
                              f"under {root} verifies ({causes}"
                              f"{'; ...' if len(skipped) > _NAMED else ''})")
    return None


def _verify(path: Path, verify: bool, process_group) -> Optional[str]:
    if not verify:
        return None
    if not has_checksums(path):
        _say(f"{path}: no checksums recorded (saved before they were); only checking "
             f"that its shards are there")
    return verify_checkpoint(path, process_group)


def _say(message: str) -> None:
    """One plain line on stderr (not a UserWarning with a source line), said once: the
    same on every rank."""
    if global_rank() == 0:
        print(message, file=sys.stderr, flush=True)


def _why_not_a_checkpoint(path: Path) -> str:
    if path.name.endswith(_TMP_SUFFIX) or _looks_uncommitted(path):
        return "incomplete (no COMPLETE marker: the save did not finish)"
    if path.is_dir():
        newest = latest_checkpoint(path) or latest_checkpoint(path / "checkpoints")
        return "not a checkpoint directory" + (f" (the newest one inside is {newest})"
                                               if newest else "")
    return "not found"


def find_checkpoint(path: str | Path) -> Path:
    """A complete checkpoint directory, or the newest one in a checkpoints root or a run
    directory."""
    path = Path(path)
    if is_complete(path):
        return path
    for root in (path, path / "checkpoints"):
        newest = latest_checkpoint(root)
        if newest is not None:
            return newest
    if _looks_uncommitted(path):
        raise CheckpointError(f"{path}: incomplete checkpoint (no {MARKER} marker)")
    raise CheckpointError(f"{path}: no complete checkpoint found")


# ---------------------------------------------------------------------------- commit

def commit(tmp: Path, final: Path) -> None:
    """Rank 0, once every rank's files are on disk: marker, rename, fsync the parent."""
    # Every file is already fsynced (DCP's by its writer, ours when written).
    marker = json.dumps({"step": checkpoint_step(final)}, indent=2) + "\n"
    fsio.write_file(tmp / MARKER, marker.encode())
    fsio.fsync_path(tmp)
    fsio.replace_dir(tmp, final)  # the same step saved again: swapped, the old one dropped


def commit_and_prune(tmp: Path, final: Path, keep_last: int) -> Optional[str]:
    """``commit``, then retention; returns an error line instead of raising so the ranks
    can agree."""
    try:
        commit(tmp, final)
    except CAUGHT as e:
        shutil.rmtree(tmp, ignore_errors=True)
        return write_error(tmp, e)
    if keep_last:
        try:
            prune_checkpoints(final.parent, keep_last, protect=final)
        except OSError as e:  # retention is housekeeping: never fail a good save for it
            warnings.warn(f"{final.parent}: could not prune old checkpoints ({describe(e)})")
    return None


# ------------------------------------------------------------------------- retention

def prune_checkpoints(root: str | Path, keep_last: int,
                      protect: Optional[Path] = None) -> list[Path]:
    """Delete complete checkpoints older than the newest ``keep_last`` (0 keeps all; the
    newest is always kept). ``protect`` (the checkpoint just committed) is never deleted:
    a run resumed from step 20 while step 50 exists still has step 50 "newer" than the
    step 30 it just saved. ``.tmp`` directories are never touched here."""
    if keep_last <= 0:
        return []
    removed = []
    protected = Path(protect).resolve() if protect is not None else None
    for path in list_checkpoints(root)[:-keep_last]:
        if path.resolve() == protected:
            continue
        fsio.remove_dir(path)  # renamed first: never half-deleted under its name
        removed.append(path)
    return removed


def clean_stale_tmp(root: str | Path) -> list[Path]:
    """At start-up, on rank 0 only, before any save: remove directories left by crashed
    saves or deletions. Never call it while a save may be in flight."""
    root = Path(root)
    if not root.is_dir():
        return []
    stale = [p for p in root.iterdir() if p.is_dir() and _is_leftover(p.name)]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def _is_leftover(name: str) -> bool:
    if name.endswith(_TMP_SUFFIX):
        return bool(_STEP_DIR.match(name[:-len(_TMP_SUFFIX)]))
    original = fsio.set_aside_original(name)
    return original is not None and bool(_STEP_DIR.match(original))
