"""Saving and loading the training state through torch.distributed.checkpoint (DCP).

A checkpoint directory holds the DCP files (``.metadata`` + ``__R_0.distcp``): model and
optimizer state under fully-qualified names that do not depend on the parallel layout
(FSDP2, tensor parallelism, pipeline stages, compile and activation checkpointing all keep
them), so a checkpoint saved on one layout loads on another: DCP reshards. Beside them:
``extra.json`` (global state: step, LR schedule, data position), ``rank-RRRRR.pt`` (each
rank's RNG, read back with ``torch.load(weights_only=True)``), ``config.yaml`` and
``meta.json``. Also here: reading a checkpoint offline, in one process.
"""
from __future__ import annotations

import dataclasses
import io
import json
import random
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
import yaml
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_model_state_dict,
                                                     set_state_dict)

from lmforge import fsio
from lmforge.checkpoint import directory
from lmforge.checkpoint.collective import (CAUGHT, CheckpointError, QuietSingleProcess, agree,
                                           describe, distributed, global_rank, group_rank,
                                           raised_checkpoint_error, world_size, write_error)
from lmforge.checkpoint.integrity import HashingWriter, check_share, missing_shard
from lmforge.checkpoint.safe_load import (METADATA_NAME, SafeLoadPlanner, SafeReader,
                                          read_metadata_file)
from lmforge.config import ConfigError, JobConfig, apply_dict, read_yaml_file

FORMAT_VERSION = 1
# Flattened optimizer state: one entry per parameter FQN, param-group hyperparameters
# included, so pipeline stages (one optimizer each) merge into one layout-free dict.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

ModelParts = Union[nn.Module, list, tuple]


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


# ------------------------------------------------------------------- serialisation

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
                              f"refuses ({describe(e)}); use tensors, numbers, strings, "
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


def collect_state(model: ModelParts, optimizers) -> tuple[dict, list[tuple[dict, Any]]]:
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

def _begin(root: Path, step: int, pg) -> tuple[Path, Path]:
    """Rank 0 creates a fresh ``step-N.tmp/`` (a stale one from a crashed attempt at the
    same step is replaced); every rank learns whether that worked."""
    final = directory.checkpoint_dir(root, step)
    tmp = directory.tmp_dir(final)
    error = None
    if group_rank(pg) == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        except OSError as e:
            failed = root if not root.is_dir() else tmp
            error = f"{failed}: cannot create checkpoint directory ({describe(e)})"
    agree(error, pg)
    return tmp, final


def write_side_files(tmp: Path, extra: dict, rank_state: Optional[dict],
                     config_dict: Optional[dict], meta: dict, pg) -> Optional[str]:
    """extra.json, meta.json, config.yaml (rank 0) and rank-R.pt (every rank); returns an
    error line instead of raising so the ranks can agree."""
    try:
        if rank_state is not None:
            fsio.write_file(directory.rank_file(tmp, global_rank()),
                            _rank_state_bytes(rank_state))
        if group_rank(pg) == 0:
            fsio.write_file(tmp / directory.EXTRA_NAME, _json_bytes(extra or {}, "extra"))
            fsio.write_file(tmp / directory.META_NAME, _json_bytes(meta, "meta"))
            if config_dict is not None:
                fsio.write_file(tmp / directory.CONFIG_NAME,
                                yaml.safe_dump(config_dict, sort_keys=False).encode())
    except CheckpointError as e:
        return str(e)
    except CAUGHT as e:
        return write_error(tmp, e)
    return None


def _meta(step: int, model: ModelParts, has_optimizer: bool) -> dict:
    return {"format": FORMAT_VERSION, "step": step, "world_size": world_size(),
            "model_args": _model_args(model), "has_optimizer": has_optimizer,
            "torch": torch.__version__, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def dcp_writer(tmp: Path):
    """DCP's writer, also recording checksums (this rank hashes its own files)."""
    own = [directory.rank_file(tmp, global_rank()).name]
    return HashingWriter(tmp, own_files=own, sync_files=True)


def stage_save(root: Path, step: int, model: ModelParts, optimizers, extra: dict,
               rank_state: Optional[dict], config_dict: Optional[dict],
               pg) -> tuple[dict, Path, Path]:
    """Collective: the state to write, and ``step-N.tmp/`` holding every file but DCP's.
    Returns ``(state, tmp, final)``."""
    state, _ = collect_state(model, optimizers)
    tmp, final = _begin(root, step, pg)
    meta = _meta(step, model, "optimizer" in state)
    agree(write_side_files(tmp, extra, rank_state, config_dict, meta, pg), pg, tmp)
    return state, tmp, final


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
    state, tmp, final = stage_save(Path(root), step, model, optimizers, extra, rank_state,
                                   config_dict, process_group)
    return persist_and_commit(state, tmp, final, process_group, keep_last)


def persist_and_commit(state: dict, tmp: Path, final: Path, pg, keep_last: int) -> Path:
    """Collective: DCP writes ``state`` into ``tmp``, then rank 0 commits it."""
    error = None
    try:
        with QuietSingleProcess():
            dcp.save(state, storage_writer=dcp_writer(tmp), process_group=pg,
                     no_dist=not distributed())
    except CAUGHT as e:
        error = write_error(tmp, e)
    agree(error, pg, tmp)  # also the barrier: every rank's files are on disk
    error = directory.commit_and_prune(tmp, final, keep_last) if group_rank(pg) == 0 else None
    agree(error, pg)
    return final


# --------------------------------------------------------------------------- loading

def read_meta(path: str | Path) -> dict:
    return _read_json(Path(path) / directory.META_NAME)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not found") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not readable JSON ({describe(e)})") from None


def _read_dcp_metadata(path: Path):
    """The DCP metadata, read without running code from it, once every data file it
    names is known to be on disk."""
    metadata = read_metadata_file(path / METADATA_NAME)
    missing = missing_shard(path, metadata)
    if missing:
        raise CheckpointError(f"{path}: {missing}")
    return metadata


def _load_request(state: dict, path: Path) -> dict:
    """What to read: everything, except optimizer hyperparameters the checkpoint lacks
    (a scheduler's ``initial_lr``, an option a newer torch added), which keep their
    current values. Tensors must all be there."""
    saved = _read_dcp_metadata(path).state_dict_metadata
    if "optimizer" not in state:
        return state
    optim = {k: v for k, v in state["optimizer"].items()
             if not k.startswith("param_groups.") or f"optimizer.{k}" in saved}
    return {**state, "optimizer": optim}


def load_checkpoint(path: str | Path, model: ModelParts, optimizers, *,
                    process_group=None) -> tuple[dict, Optional[dict]]:
    """Load model (and optimizer) state into ``model``/``optimizers`` on any layout (DCP
    reshards); collective. Returns ``(extra, rank_state)``; ``rank_state`` is None when
    the saving run had no file for this rank (the caller reseeds)."""
    path = Path(path)
    if not directory.is_complete(path):
        raise CheckpointError(f"{path}: not a complete checkpoint (no {directory.MARKER} marker)")
    meta = read_meta(path)
    state, per_part = collect_state(model, optimizers)
    if "optimizer" in state and not meta.get("has_optimizer", True):
        raise CheckpointError(f"{path}: holds no optimizer state (saved without one)")
    request = _load_request(state, path)
    try:
        with QuietSingleProcess():
            dcp.load(request, storage_reader=SafeReader(path), planner=SafeLoadPlanner(path),
                     process_group=process_group, no_dist=not distributed())
    except CAUGHT as e:
        raise raised_checkpoint_error(e) or CheckpointError(
            f"{path}: cannot load into this model ({describe(e)})") from None
    if "optimizer" in state:
        state["optimizer"].update(request["optimizer"])
    _hand_to_parts(state, per_part, model, optimizers)
    return _read_json(path / directory.EXTRA_NAME), _read_rank_state(path)


def _hand_to_parts(state: dict, per_part: list, model: ModelParts, optimizers) -> None:
    """dcp.load fills tensors in place but sets non-tensor values (param-group
    hyperparameters) in the merged dicts: hand each part its values from those."""
    for (part, opt), (msd, osd) in zip(_pairs(model, optimizers), per_part):
        msd = {k: state["model"][k] for k in msd}
        if osd is None:
            set_model_state_dict(part, msd, options=_OPTIONS)
        else:
            osd = {k: state["optimizer"][k] for k in osd}
            set_state_dict(part, opt, model_state_dict=msd, optim_state_dict=osd,
                           options=_OPTIONS)


def _read_rank_state(path: Path) -> Optional[dict]:
    rank_path = directory.rank_file(path, global_rank())
    if not rank_path.is_file():
        return None
    try:
        return torch.load(rank_path, weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{rank_path}: not readable ({describe(e)})") from None


# ------------------------------------------------------------------ offline reading

def model_tensor_metadata(ckpt_dir: str | Path) -> dict:
    """The checkpoint's model tensors (``model.<FQN>`` -> DCP metadata), none read."""
    metadata = _read_dcp_metadata(Path(ckpt_dir)).state_dict_metadata
    return {key: item for key, item in metadata.items()
            if key.startswith("model.") and isinstance(item, TensorStorageMetadata)}


def read_model_state(ckpt_dir: str | Path, *, verify: bool = True
                     ) -> dict[str, torch.Tensor]:
    """A checkpoint's model tensors, whole (shards reassembled), on the CPU, without a
    process group. Keys are the model's FQNs. ``verify``: check the recorded checksums
    first (an export of damaged weights would look fine and be wrong)."""
    path = Path(ckpt_dir)
    problem = check_share(path) if verify else None
    if problem:
        raise CheckpointError(f"{path}: {problem}")
    sd = {key: torch.empty(item.size, dtype=item.properties.dtype)
          for key, item in model_tensor_metadata(path).items()}
    if not sd:
        raise CheckpointError(f"{path}: holds no model tensors")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*single process")
            dcp.load(sd, storage_reader=SafeReader(path), planner=SafeLoadPlanner(path),
                     no_dist=True)
    except CAUGHT as e:
        raise raised_checkpoint_error(e) or CheckpointError(
            f"{path}: cannot read the model tensors ({describe(e)})") from None
    return {key[len("model."):]: value for key, value in sd.items()}


def read_job_config(ckpt_dir: str | Path) -> JobConfig:
    path = Path(ckpt_dir) / directory.CONFIG_NAME
    if not path.is_file():
        raise CheckpointError(f"{path}: not found (the checkpoint has no config)")
    raw = read_yaml_file(path) or {}
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: top level must be a mapping of config sections")
    cfg = JobConfig()
    try:
        apply_dict(cfg, raw)
    except ConfigError as e:  # e.g. a section another lmforge version wrote
        raise CheckpointError(f"{path}: {e}") from None
    return cfg
