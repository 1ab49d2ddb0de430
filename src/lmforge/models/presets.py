"""The architecture of a run: a named size (any family's preset) or a model's
config.json, with the config's ``model.*`` fields on top; and the model checks run
before any compute."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional

from lmforge.config import ConfigError, JobConfig, check_parallel_fits
from lmforge.models.hf import read_hf_config
from lmforge.models.registry import PRESETS, ModelFamily, family_for_config, family_of

__all__ = ["PRESETS", "check_model_args", "job_family", "model_args", "validate_job"]


def check_model_args(args, seq_len: Optional[int] = None) -> None:
    """Refuse shapes the model cannot have (heads, RoPE) or a sequence it cannot take."""
    if args.n_heads % args.n_kv_heads:
        raise ConfigError(f"model.n_kv_heads: n_heads ({args.n_heads}) must be divisible "
                          f"by n_kv_heads ({args.n_kv_heads})")
    family_of(args).check_args(args)
    if seq_len is not None and seq_len > args.max_seq_len:
        raise ConfigError(f"data.seq_len: {seq_len} exceeds the model's max_seq_len "
                          f"({args.max_seq_len})")


_ARG_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim",
               "max_seq_len", "rope_theta", "norm_eps", "tie_embeddings")


def model_args(cfg: JobConfig, base: Optional[Any] = None) -> Any:
    """The model architecture: a preset (or ``base``, e.g. read from config.json) with the
    fields set in ``model.*`` on top."""
    args = base if base is not None else PRESETS[cfg.model.preset]
    changes = {k: getattr(cfg.model, k) for k in _ARG_FIELDS if getattr(cfg.model, k) is not None}
    if "n_heads" in changes and "n_kv_heads" not in changes and args.n_kv_heads == args.n_heads:
        changes["n_kv_heads"] = changes["n_heads"]
    return dataclasses.replace(args, **changes)


def job_family(cfg: JobConfig) -> ModelFamily:
    """The family a validated job trains: model.init_from's config.json model_type, or the
    preset's."""
    if cfg.model.init_from:
        return family_for_config(read_hf_config(cfg.model.init_from),
                                 f"{cfg.model.init_from}/config.json")
    return family_of(PRESETS[cfg.model.preset])


def validate_job(cfg: JobConfig, world_size: int = 1, distributed: bool = False) -> JobConfig:
    """Everything refused before any compute: the config's own fields
    (``JobConfig.validate``) and the model section, which needs the presets."""
    cfg.validate(world_size=world_size, distributed=distributed)
    _validate_model(cfg)
    return cfg


def _validate_model(cfg: JobConfig) -> None:
    m = cfg.model
    if m.preset is not None and m.preset not in PRESETS:
        raise ConfigError(f"model.preset: unknown preset {m.preset!r} "
                          f"(known: {', '.join(sorted(PRESETS))})")
    if m.preset is None and m.init_from is None:
        raise ConfigError("model.preset: set a preset or model.init_from")
    if m.init_from is not None:  # shape checks against config.json: when it is read
        if not Path(m.init_from).is_dir():
            raise ConfigError(f"model.init_from: {m.init_from} is not a directory")
        return
    args = model_args(cfg)
    check_model_args(args, cfg.data.seq_len)
    check_parallel_fits(cfg, args)
