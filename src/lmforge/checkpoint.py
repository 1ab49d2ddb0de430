"""Distributed checkpoints: save/load through torch.distributed.checkpoint (DCP), atomic
commit, retention, asynchronous saving, and export to Hugging Face / PEFT.

A checkpoint is a directory ``ROOT/step-NNNNNNN/`` holding

- the DCP files (``.metadata`` + ``__R_0.distcp``): model and optimizer state under
  fully-qualified names that do not depend on the parallel layout (FSDP2, tensor
  parallelism, pipeline stages, compile and activation checkpointing all keep them), so
  a checkpoint saved on one layout loads on another: DCP reshards;
- ``extra.json``: global state, identical on all ranks (step, LR schedule, data position);
- ``rank-RRRRR.pt``: per-rank state (RNG), read back with ``torch.load(weights_only=True)``;
- ``config.yaml`` (the resolved job config), ``meta.json`` (step, world size, model
  architecture) and the ``COMPLETE`` marker.

Every rank writes into ``step-NNNNNNN.tmp/``; once all are done, rank 0 writes the marker
and renames the directory. Only directories named ``step-N`` that hold the marker are ever
listed or loaded, so a crash mid-write leaves nothing that looks like a checkpoint, and
old checkpoints are pruned only after a new one is committed.
"""
from __future__ import annotations

import dataclasses
import io
import json
import os
import random
import re
import shutil
import time
import uuid
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import yaml
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_model_state_dict,
                                                     set_state_dict)

from lmforge.models.llama import LlamaArgs, RopeScaling, build_llama, materialize

try:  # a BaseException, not an Exception: it must be caught by name
    from torch.distributed.checkpoint.api import CheckpointException as _DCPException
except ImportError:  # pragma: no cover
    class _DCPException(Exception):
        pass


MARKER = "COMPLETE"
EXTRA_NAME = "extra.json"
META_NAME = "meta.json"
CONFIG_NAME = "config.yaml"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step-(\d{7,})$")
# Flattened optimizer state: one entry per parameter FQN, param-group hyperparameters
# included, so pipeline stages (one optimizer each) merge into one layout-free dict.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
_CAUGHT = (Exception, _DCPException)

ModelParts = Union[nn.Module, list, tuple]


class CheckpointError(ValueError):
    """A checkpoint cannot be written, found or read; one line naming the directory."""


# ---------------------------------------------------------------------------- naming

def checkpoint_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:07d}"


def checkpoint_step(path: str | Path) -> int:
    match = _STEP_DIR.match(Path(path).name)
    if not match:
        raise CheckpointError(f"{path}: not a checkpoint directory (expected step-NNNNNNN)")
    return int(match.group(1))


def is_complete(path: str | Path) -> bool:
    path = Path(path)
    return bool(_STEP_DIR.match(path.name)) and (path / MARKER).is_file()


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


def resolve_resume(resume: Optional[str], root: str | Path) -> Optional[Path]:
    """``train.resume``: None/"" -> None; ``auto`` -> the newest complete checkpoint under
    ``root`` (None when there is none); a path -> that checkpoint, which must be complete."""
    if resume is None or str(resume).strip() == "":
        return None
    if str(resume).strip().lower() == "auto":
        return latest_checkpoint(root)
    path = Path(resume)
    if is_complete(path):
        return path
    if path.name.endswith(".tmp") or (path.is_dir() and _STEP_DIR.match(path.name)):
        why = "incomplete (no COMPLETE marker: the save did not finish)"
    elif path.is_dir():
        newest = latest_checkpoint(path) or latest_checkpoint(path / "checkpoints")
        why = "not a checkpoint directory" + (f" (the newest one inside is {newest})"
                                              if newest else "")
    else:
        why = "not found"
    raise CheckpointError(f"train.resume: {path}: {why}")


# ------------------------------------------------------------------------ RNG state

def capture_rng() -> dict:
    """This process's random generators, as tensors and plain lists (loadable with
    ``torch.load(weights_only=True)``)."""
    version, internal, gauss_next = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
        "numpy": {"kind": str(kind), "keys": torch.from_numpy(keys.astype(np.int64)),
                  "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # this rank's current device
    return state


def restore_rng(state: Optional[dict]) -> None:
    """Inverse of ``capture_rng``; generators missing from ``state`` are left alone."""
    if not state:
        return
    if "python" in state:
        p = state["python"]
        random.setstate((p["version"], tuple(p["internal"]), p["gauss_next"]))
    if "numpy" in state:
        n = state["numpy"]
        keys = n["keys"].numpy() if torch.is_tensor(n["keys"]) else np.asarray(n["keys"])
        np.random.set_state((n["kind"], keys.astype(np.uint32), n["pos"], n["has_gauss"],
                             n["cached"]))
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# ---------------------------------------------------------------- process-group helpers

def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _group_rank(pg) -> int:
    return dist.get_rank(pg) if _distributed() else 0


def _global_rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _world_size() -> int:
    return dist.get_world_size() if _distributed() else 1


def _gather_errors(error: Optional[str], pg) -> list[str]:
    """Every rank's error (None = fine); also a barrier."""
    if not _distributed():
        return [error] if error else []
    errors: list = [None] * dist.get_world_size(pg)
    dist.all_gather_object(errors, error, group=pg)
    return [e for e in errors if e]


def _agree(error: Optional[str], pg, tmp: Optional[Path] = None) -> None:
    """Raise the same ``CheckpointError`` on every rank when any rank failed (rank 0
    removes the partial directory first)."""
    errors = _gather_errors(error, pg)
    if not errors:
        return
    if tmp is not None:
        if _group_rank(pg) == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if _distributed():
            dist.barrier(group=pg)  # no rank returns while the partial directory exists
    raise CheckpointError(errors[0])


class _Quiet:
    """DCP warns on every call made without a process group; here one process is meant."""

    def __enter__(self):
        self._ctx = warnings.catch_warnings()
        self._ctx.__enter__()
        if not _distributed():
            warnings.filterwarnings("ignore", message=r".*assuming the intent is to .* in a "
                                    r"single process")

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)


def _describe(err: BaseException) -> str:
    """One line for an exception, digging the first real cause out of DCP's wrapper."""
    if isinstance(err, _DCPException):
        failures = getattr(err, "failures", {}) or {}
        for wrapped in failures.values():
            inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
            if isinstance(inner, BaseException):
                return _describe(inner)
        return type(err).__name__
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    return " ".join(str(err).split()) or type(err).__name__


def _write_error(directory: Path, err: BaseException) -> str:
    return f"{directory}: cannot write checkpoint ({_describe(err)})"


# ----------------------------------------------------------------------- file helpers

def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _json_bytes(data: Any, what: str) -> bytes:
    try:
        return (json.dumps(data, indent=2, allow_nan=True) + "\n").encode()
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{what}: not JSON-serialisable ({e})") from None


def _rank_state_bytes(rank_state: dict) -> bytes:
    """Serialised per-rank state, checked now to load with ``weights_only=True`` (so a
    bad value fails at save time rather than at resume time)."""
    buffer = io.BytesIO()
    torch.save(rank_state, buffer)
    try:
        torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    except Exception as e:
        raise CheckpointError(f"rank_state: holds a value torch.load(weights_only=True) "
                              f"refuses ({_describe(e)}); use tensors, numbers, strings, "
                              f"lists and dicts") from None
    return buffer.getvalue()


# ------------------------------------------------------------------- state collection

def _pairs(model: ModelParts, optimizers) -> list[tuple[nn.Module, Any]]:
    """(model part, its optimizer(s)) pairs. A list of parts (pipeline stages) takes
    None or a list with one optimizer (or None) per part."""
    if isinstance(model, (list, tuple)):
        parts = list(model)
        opts = [None] * len(parts) if optimizers is None else list(optimizers)
        if len(opts) != len(parts):
            raise ValueError(f"checkpoint: {len(parts)} model parts but {len(opts)} "
                             f"optimizers (pass one per part, or None)")
        return list(zip(parts, opts))
    if isinstance(optimizers, (list, tuple)) and not optimizers:
        optimizers = None
    return [(model, optimizers)]


def _part_state(part: nn.Module, optimizers) -> tuple[dict, Optional[dict]]:
    if optimizers is None:
        return get_model_state_dict(part, options=_OPTIONS), None
    return get_state_dict(part, optimizers, options=_OPTIONS)


def _merge(into: dict, part: dict, what: str) -> None:
    clash = [k for k in part if k in into]
    if clash:
        raise ValueError(f"checkpoint: {what} key {clash[0]} appears in two model parts")
    into.update(part)


def _collect_state(model: ModelParts, optimizers) -> tuple[dict, list[tuple[dict, Any]]]:
    """``{"model": ..., "optimizer": ...}`` over all parts, plus each part's own dicts (the
    same tensor objects) for ``set_state_dict`` after a load."""
    model_sd: dict = {}
    optim_sd: dict = {}
    per_part = []
    has_optim = False
    for part, opt in _pairs(model, optimizers):
        msd, osd = _part_state(part, opt)
        _merge(model_sd, msd, "model")
        if osd is not None:
            has_optim = True
            _merge(optim_sd, osd, "optimizer")
        per_part.append((msd, osd))
    state = {"model": model_sd}
    if has_optim:
        state["optimizer"] = optim_sd
    return state, per_part


def _model_args(model: ModelParts) -> Optional[dict]:
    parts = model if isinstance(model, (list, tuple)) else [model]
    for part in parts:
        args = getattr(part, "args", None)
        if dataclasses.is_dataclass(args):
            return dataclasses.asdict(args)
    return None


# ---------------------------------------------------------------------------- saving

def _tmp_dir(final: Path) -> Path:
    return final.with_name(final.name + ".tmp")


def _begin(root: Path, step: int, pg) -> tuple[Path, Path]:
    """Rank 0 creates a fresh ``step-N.tmp/`` (a stale one from a crashed attempt at the
    same step is replaced); every rank learns whether that worked."""
    final = checkpoint_dir(root, step)
    tmp = _tmp_dir(final)
    error = None
    if _group_rank(pg) == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        except OSError as e:
            failed = root if not root.is_dir() else tmp
            error = f"{failed}: cannot create checkpoint directory ({_describe(e)})"
    _agree(error, pg)
    return tmp, final


def _write_side_files(tmp: Path, extra: dict, rank_state: Optional[dict],
                      config_dict: Optional[dict], meta: dict, pg) -> Optional[str]:
    """extra.json, meta.json, config.yaml (rank 0) and rank-R.pt (every rank); returns an
    error line instead of raising so the ranks can agree."""
    try:
        if rank_state is not None:
            _write_file(tmp / f"rank-{_global_rank():05d}.pt", _rank_state_bytes(rank_state))
        if _group_rank(pg) == 0:
            _write_file(tmp / EXTRA_NAME, _json_bytes(extra or {}, "extra"))
            _write_file(tmp / META_NAME, _json_bytes(meta, "meta"))
            if config_dict is not None:
                _write_file(tmp / CONFIG_NAME,
                            yaml.safe_dump(config_dict, sort_keys=False).encode())
    except CheckpointError as e:
        return str(e)
    except _CAUGHT as e:
        return _write_error(tmp, e)
    return None


def _meta(step: int, model: ModelParts, has_optimizer: bool) -> dict:
    return {"format": FORMAT_VERSION, "step": step, "world_size": _world_size(),
            "model_args": _model_args(model), "has_optimizer": has_optimizer,
            "torch": torch.__version__, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def _writer(tmp: Path):
    return dcp.FileSystemWriter(str(tmp), sync_files=True)


def _commit(tmp: Path, final: Path) -> None:
    """Rank 0, once every rank's files are on disk: marker, rename, fsync the parent."""
    # Every file is already fsynced (DCP's by its writer, ours when written).
    _write_file(tmp / MARKER, _json_bytes({"step": checkpoint_step(final)}, "marker"))
    _fsync_path(tmp)
    old = None
    if final.exists():  # the same step saved again: swap, then drop the old one
        old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_path(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _commit_and_prune(tmp: Path, final: Path, keep_last: int) -> Optional[str]:
    try:
        _commit(tmp, final)
    except _CAUGHT as e:
        shutil.rmtree(tmp, ignore_errors=True)
        return _write_error(tmp, e)
    if keep_last:
        try:
            prune_checkpoints(final.parent, keep_last)
        except OSError as e:  # retention is housekeeping: never fail a good save for it
            warnings.warn(f"{final.parent}: could not prune old checkpoints ({_describe(e)})")
    return None


def save_checkpoint(root: str | Path, step: int, model: ModelParts, optimizers,
                    extra: dict, rank_state: Optional[dict], config_dict: Optional[dict], *,
                    process_group=None, keep_last: int = 0) -> Path:
    """Save on all ranks (collective). Returns the committed ``root/step-NNNNNNN``.

    ``model``: a module (plain, FSDP2, tensor-parallel, compiled) or a list of pipeline
    stage modules; ``optimizers``: an optimizer, a list (one per stage), or None.
    ``extra``: JSON-able state identical on every rank, written once. ``rank_state``: this
    rank's own state (``capture_rng()`` and the like). ``keep_last`` > 0 prunes older
    checkpoints after the commit. Raises ``CheckpointError`` on every rank if any rank
    fails; the previous checkpoints are then untouched."""
    root = Path(root)
    state, _ = _collect_state(model, optimizers)
    tmp, final = _begin(root, step, process_group)
    meta = _meta(step, model, "optimizer" in state)
    _agree(_write_side_files(tmp, extra, rank_state, config_dict, meta, process_group),
           process_group, tmp)
    return _persist_and_commit(state, tmp, final, process_group, keep_last)


def _persist_and_commit(state: dict, tmp: Path, final: Path, pg, keep_last: int) -> Path:
    error = None
    try:
        with _Quiet():
            dcp.save(state, storage_writer=_writer(tmp), process_group=pg,
                     no_dist=not _distributed())
    except _CAUGHT as e:
        error = _write_error(tmp, e)
    _agree(error, pg, tmp)  # also the barrier: every rank's files are on disk
    error = _commit_and_prune(tmp, final, keep_last) if _group_rank(pg) == 0 else None
    _agree(error, pg)
    return final


# --------------------------------------------------------------------------- loading

def read_meta(path: str | Path) -> dict:
    return _read_json(Path(path) / META_NAME)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not found") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not readable JSON ({_describe(e)})") from None


def _load_request(state: dict, path: Path) -> dict:
    """What to read: everything, except optimizer hyperparameters the checkpoint lacks
    (a scheduler's ``initial_lr``, an option a newer torch added), which keep their
    current values. Tensors must all be there."""
    if "optimizer" not in state:
        return state
    try:
        saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception as e:
        raise CheckpointError(f"{path}: no readable DCP metadata ({_describe(e)})") from None
    optim = {k: v for k, v in state["optimizer"].items()
             if not k.startswith("param_groups.") or f"optimizer.{k}" in saved}
    return {**state, "optimizer": optim}


def load_checkpoint(path: str | Path, model: ModelParts, optimizers, *,
                    process_group=None) -> tuple[dict, Optional[dict]]:
    """Load model (and optimizer) state into ``model``/``optimizers`` on any layout (DCP
    reshards); collective. Returns ``(extra, rank_state)``; ``rank_state`` is None when
    the saving run had no file for this rank (the caller reseeds)."""
    path = Path(path)
    if not is_complete(path):
        raise CheckpointError(f"{path}: not a complete checkpoint (no {MARKER} marker)")
    meta = read_meta(path)
    state, per_part = _collect_state(model, optimizers)
    if "optimizer" in state and not meta.get("has_optimizer", True):
        raise CheckpointError(f"{path}: holds no optimizer state (saved without one)")
    request = _load_request(state, path)
    try:
        with _Quiet():
            dcp.load(request, checkpoint_id=str(path), process_group=process_group,
                     no_dist=not _distributed())
    except _CAUGHT as e:
        raise CheckpointError(f"{path}: cannot load into this model ({_describe(e)})"
                              ) from None
    if "optimizer" in state:
        state["optimizer"].update(request["optimizer"])
    # dcp.load fills tensors in place but sets non-tensor values (param-group
    # hyperparameters) in the merged dicts: hand each part its values from those.
    pairs = _pairs(model, optimizers)
    for (part, opt), (msd, osd) in zip(pairs, per_part):
        msd = {k: state["model"][k] for k in msd}
        if osd is None:
            set_model_state_dict(part, msd, options=_OPTIONS)
        else:
            osd = {k: state["optimizer"][k] for k in osd}
            set_state_dict(part, opt, model_state_dict=msd, optim_state_dict=osd,
                           options=_OPTIONS)
    extra = _read_json(path / EXTRA_NAME)
    rank_file = path / f"rank-{_global_rank():05d}.pt"
    rank_state = None
    if rank_file.is_file():
        try:
            rank_state = torch.load(rank_file, weights_only=True)
        except Exception as e:
            raise CheckpointError(f"{rank_file}: not readable ({_describe(e)})") from None
    return extra, rank_state


# ------------------------------------------------------------------------- retention

def prune_checkpoints(root: str | Path, keep_last: int) -> list[Path]:
    """Delete complete checkpoints older than the newest ``keep_last`` (0 keeps all; the
    newest is always kept). ``.tmp`` directories are never touched here."""
    if keep_last <= 0:
        return []
    removed = []
    for path in list_checkpoints(root)[:-keep_last]:
        # Rename first (atomic): a deletion cut short never leaves a half-deleted
        # directory that still looks complete.
        doomed = path.with_name(f".{path.name}.deleting-{uuid.uuid4().hex[:8]}")
        os.replace(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        removed.append(path)
    return removed


def clean_stale_tmp(root: str | Path) -> list[Path]:
    """At start-up, on rank 0 only, before any save: remove directories left by crashed
    saves or deletions. Never call it while a save may be in flight."""
    root = Path(root)
    if not root.is_dir():
        return []
    stale = [p for p in root.iterdir() if p.is_dir() and (
        (p.name.endswith(".tmp") and _STEP_DIR.match(p.name[:-4]))
        or re.match(r"^\.step-\d+\.(deleting|old)-", p.name))]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


# ------------------------------------------------------------------------------ async

class AsyncCheckpointer:
    """Checkpoints that do not stall training: ``save`` copies the state to CPU memory
    and returns; a background thread writes it. Call ``maybe_finalize()`` every step
    (commits a finished save on rank 0, never blocks) and ``wait()`` before exiting.

    Construct, ``save`` and ``wait`` on every rank (collectives; the constructor creates
    a gloo group of its own, so checkpoint traffic in the background never interleaves
    with training collectives). With ``use_async=False``, or where ``dcp.async_save`` is
    refused, saves synchronously."""

    def __init__(self, root: str | Path, *, keep_last: int = 0, process_group=None,
                 use_async: bool = True):
        self.root = Path(root)
        self.keep_last = keep_last
        self.use_async = use_async and hasattr(dcp, "async_save")
        self._pending: Optional[tuple[Future, Path, Path]] = None
        self._error: Optional[str] = None  # a failed save, raised at the next wait()
        self._pg = process_group
        if self._pg is None and _distributed() and self.use_async:
            self._pg = dist.new_group(backend="gloo")

    @property
    def pending_step(self) -> Optional[int]:
        return checkpoint_step(self._pending[2]) if self._pending else None

    def save(self, step: int, model: ModelParts, optimizers, extra: dict,
             rank_state: Optional[dict], config_dict: Optional[dict]) -> Optional[Path]:
        """Start a save (waiting first for the previous one). Returns the final path when
        the save was synchronous, None while it is in flight."""
        self.wait()
        if not self.use_async:
            return save_checkpoint(self.root, step, model, optimizers, extra, rank_state,
                                   config_dict, process_group=self._pg,
                                   keep_last=self.keep_last)
        state, _ = _collect_state(model, optimizers)
        tmp, final = _begin(self.root, step, self._pg)
        meta = _meta(step, model, "optimizer" in state)
        _agree(_write_side_files(tmp, extra, rank_state, config_dict, meta, self._pg),
               self._pg, tmp)
        try:
            with _Quiet():
                future = dcp.async_save(state, storage_writer=_writer(tmp),
                                        process_group=self._pg, no_dist=not _distributed())
        except (AssertionError, RuntimeError, NotImplementedError, TypeError) as e:
            # Raised before any collective (e.g. a group without a CPU backend): every
            # rank takes this branch alike.
            warnings.warn(f"asynchronous checkpointing unavailable ({_describe(e)}); "
                          f"saving synchronously from now on")
            self.use_async = False
            return _persist_and_commit(state, tmp, final, self._pg, self.keep_last)
        if not isinstance(future, Future):  # newer torch: AsyncSaveResponse
            future = future.upload_completion
        self._pending = (future, tmp, final)
        return None

    def maybe_finalize(self) -> Optional[Path]:
        """Commit the in-flight save if it has finished (never blocks, no collective);
        returns its path then. A failed save is warned about here and raised on every
        rank by the next ``save()`` or ``wait()``."""
        if self._pending is None or not self._pending[0].done():
            return None
        final = self._finish_pending()
        if self._error:
            warnings.warn(f"asynchronous checkpoint failed: {self._error}")
        return final

    def wait(self) -> Optional[Path]:
        """Collective: block until the in-flight save (if any) is written and committed.
        Raises ``CheckpointError`` on every rank when a save failed on any rank."""
        final = self._finish_pending() if self._pending is not None else None
        error, self._error = self._error, None
        _agree(error, self._pg)
        return final

    def _finish_pending(self) -> Optional[Path]:
        future, tmp, final = self._pending
        self._pending = None
        error = None
        try:
            future.result()
        except _CAUGHT as e:  # DCP raises the same failure on every rank
            error = _write_error(tmp, e)
        if _group_rank(self._pg) == 0:
            if error:
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                error = _commit_and_prune(tmp, final, self.keep_last)
        if error:
            self._error = self._error or error
            return None
        return final

    def close(self) -> None:
        self.wait()


# ----------------------------------------------------------------------------- export

def read_model_state(ckpt_dir: str | Path) -> dict[str, torch.Tensor]:
    """A checkpoint's model tensors, whole (shards reassembled), on the CPU, without a
    process group. Keys are the model's FQNs."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = Path(ckpt_dir)
    reader = dcp.FileSystemReader(str(path))
    try:
        metadata = reader.read_metadata()
    except Exception as e:
        raise CheckpointError(f"{path}: no readable DCP metadata ({_describe(e)})") from None
    sd = {key: torch.empty(item.size, dtype=item.properties.dtype)
          for key, item in metadata.state_dict_metadata.items()
          if key.startswith("model.") and isinstance(item, TensorStorageMetadata)}
    if not sd:
        raise CheckpointError(f"{path}: holds no model tensors")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*single process")
        dcp.load(sd, storage_reader=reader, no_dist=True)
    return {key[len("model."):]: value for key, value in sd.items()}


def checkpoint_model_args(ckpt_dir: str | Path, model_sd: Optional[dict] = None):
    """The architecture a checkpoint was saved with: meta.json's record, else rebuilt
    from config.yaml (vocabulary size read off the embedding)."""
    from lmforge.models.presets import model_args

    path = Path(ckpt_dir)
    recorded = read_meta(path).get("model_args") if (path / META_NAME).is_file() else None
    if recorded:
        scaling = recorded.get("rope_scaling")
        return LlamaArgs(**{**recorded,
                            "rope_scaling": RopeScaling(**scaling) if scaling else None})
    cfg = read_job_config(path)
    base = None
    if cfg.model.init_from and Path(cfg.model.init_from, "config.json").is_file():
        from lmforge.models.hf import args_from_hf_config, read_hf_config
        base = args_from_hf_config(read_hf_config(cfg.model.init_from))
    args = model_args(cfg, base=base)
    if model_sd is not None and "tok_embeddings.weight" in model_sd:
        args = dataclasses.replace(args, vocab_size=model_sd["tok_embeddings.weight"].shape[0])
    return args


def read_job_config(ckpt_dir: str | Path):
    from lmforge.config import JobConfig, apply_dict

    path = Path(ckpt_dir) / CONFIG_NAME
    if not path.is_file():
        raise CheckpointError(f"{path}: not found (the checkpoint has no config)")
    cfg = JobConfig()
    apply_dict(cfg, yaml.safe_load(path.read_text()) or {})
    return cfg


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
    if path.is_dir() and (path.name.endswith(".tmp") or _STEP_DIR.match(path.name)):
        raise CheckpointError(f"{path}: incomplete checkpoint (no {MARKER} marker)")
    raise CheckpointError(f"{path}: no complete checkpoint found")


def _tokenizer_source(ckpt_dir: Path, tokenizer_dir, cfg) -> Optional[Path]:
    candidates = [tokenizer_dir] if tokenizer_dir else [
        ckpt_dir.parent.parent / "tokenizer",
        cfg.model.tokenizer if cfg else None, cfg.model.init_from if cfg else None]
    for candidate in candidates:
        if candidate and (Path(candidate) / "tokenizer.json").is_file():
            return Path(candidate)
    if tokenizer_dir:
        raise CheckpointError(f"{tokenizer_dir}: no tokenizer.json")
    return None


def chat_export(cfg, tokenizer):
    """(tokenizer, generation_config) for an export: the chat template the run trained
    with (an SFT run's ``data.template``; else the tokenizer's own) goes into the
    tokenizer files when it is Jinja, and its end-of-turn token into ``eos_token_id``, so
    ``generate`` stops where the template ends a reply."""
    if tokenizer is None:
        return None, None
    from lmforge.data.templates import get_template

    sft = cfg is not None and cfg.data.kind == "sft"
    try:
        template = get_template(cfg.data.template if sft else "auto", tokenizer)
        eot = template.end_of_turn_id(tokenizer)
    except ValueError as e:  # DataError: a template that cannot end a reply
        if sft:
            raise
        warnings.warn(f"export: the tokenizer's chat template is left as it is, without an "
                      f"end-of-turn token in generation_config.json ({e})", stacklevel=2)
        return tokenizer, None
    if template.source is not None:
        tokenizer = tokenizer.with_chat_template(template.source)
    if eot == tokenizer.eos_id:
        return tokenizer, None
    return tokenizer, {"eos_token_id": [i for i in (tokenizer.eos_id, eot) if i is not None]}


EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def export_checkpoint(ckpt_dir: str | Path, out_dir: str | Path, fmt: str = "hf",
                      tokenizer_dir: Optional[str | Path] = None,
                      dtype: Optional[str] = None) -> Path:
    """Offline, single process: a checkpoint -> a Hugging Face model directory (``hf``;
    ``merged`` = the same with LoRA adapters merged in) or a PEFT adapter (``peft``).
    The tokenizer comes from ``tokenizer_dir``, else the run's ``tokenizer/`` beside
    ``checkpoints/``, else the job config's tokenizer or init_from directory."""
    from lmforge.models.hf import save_hf_model

    if fmt not in ("hf", "peft", "merged"):
        raise CheckpointError(f"--format: {fmt!r} is not one of hf, peft, merged")
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise CheckpointError(f"--dtype: {dtype!r} is not one of {', '.join(EXPORT_DTYPES)}")
    path = find_checkpoint(ckpt_dir)
    sd = read_model_state(path)
    cfg = read_job_config(path) if (path / CONFIG_NAME).is_file() else None
    args = checkpoint_model_args(path, sd)
    source = _tokenizer_source(path, tokenizer_dir, cfg)
    tokenizer = None
    if source is not None:
        from lmforge.data.tokenizer import load_tokenizer
        tokenizer = load_tokenizer(source)
    torch_dtype = EXPORT_DTYPES[dtype] if dtype else None
    tokenizer, generation = chat_export(cfg, tokenizer)
    lora_keys = [k for k in sd if _is_lora_key(k)]
    if fmt == "peft" and not lora_keys:
        raise CheckpointError(f"{path}: --format peft needs LoRA parameters and this "
                              f"checkpoint has none (use --format hf)")
    if lora_keys:
        if fmt == "hf":
            raise CheckpointError(f"{path}: holds LoRA adapters ({lora_keys[0]}, ...): use "
                                  f"--format merged (full model) or --format peft (adapter)")
        return _export_lora(fmt, sd, args, cfg, Path(out_dir), tokenizer, path, torch_dtype,
                            generation)
    model = materialize(build_llama(args, "meta"), "cpu", init=False)
    _load_exact(model, sd, path)
    return save_hf_model(model, out_dir, tokenizer=tokenizer, dtype=torch_dtype,
                         generation_config=generation)


def _is_lora_key(key: str) -> bool:
    return key.rsplit(".", 1)[-1] in ("lora_a", "lora_b")


def _export_lora(fmt: str, sd: dict, args, cfg, out_dir: Path, tokenizer, path: Path,
                 dtype: Optional[torch.dtype], generation_config: Optional[dict]) -> Path:
    """Rebuild the LoRA model the checkpoint was saved from and hand it to
    ``lmforge.peft.adapters`` (adapter only, or merged into a plain HF model)."""
    try:
        from lmforge.peft import adapters
        from lmforge.peft.lora import apply_lora
    except ModuleNotFoundError:
        raise CheckpointError(f"{path}: --format {fmt} needs lmforge.peft, which this "
                              f"installation lacks") from None
    lora_cfg = getattr(cfg, "lora", None)
    if lora_cfg is None:
        raise CheckpointError(f"{path}: holds LoRA parameters but no lora section in its "
                              f"{CONFIG_NAME}")
    modules = sorted({k.rsplit(".", 1)[0] for k in sd if _is_lora_key(k)})
    # Rank from the tensors themselves, so the rebuilt layers always fit the weights.
    lora_cfg = dataclasses.replace(lora_cfg, rank=sd[f"{modules[0]}.lora_a"].shape[0])
    model = build_llama(args, "meta")
    apply_lora(model, lora_cfg, module_names=modules)
    quantized = bool(getattr(lora_cfg, "quantize", None))
    # A quantized base needs real (any) weights to quantize before its tensors load.
    materialize(model, "cpu", init=quantized)
    if quantized:
        from lmforge.peft.quant import quantize_base
        quantize_base(model, lora_cfg.quantize, "all-linear")
    _load_exact(model, sd, path)
    if fmt == "peft":
        return adapters.save_adapter(model, out_dir, base_model_path=cfg.model.init_from,
                                     lora_cfg=lora_cfg)
    return adapters.export_merged(model, out_dir, tokenizer=tokenizer, dtype=dtype,
                                  generation_config=generation_config)


def _load_exact(model: nn.Module, sd: dict, path: Path) -> None:
    try:
        model.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        raise CheckpointError(f"{path}: model state does not match its config "
                              f"({_describe(e)[:300]})") from None
