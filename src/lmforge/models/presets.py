"""The architecture of a run: a named size (any family's preset) or a model's
config.json, with the config's ``model.*`` fields on top; and the model checks run
before any compute."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional

from lmforge.config import ConfigError, JobConfig, check_parallel_fits
from lmforge.models.hf import read_hf_config, read_model_args
from lmforge.models.moe import check_ep
from lmforge.models.registry import PRESETS, ModelFamily, family_for_config, family_of

__all__ = ["PRESETS", "check_layout_fits", "check_model_args", "job_family", "job_model_args",
           "model_args", "resolve_model_args", "validate_job"]


def check_model_args(args, seq_len: Optional[int] = None) -> None:
    """Refuse shapes the model cannot have (heads, RoPE) or a sequence it cannot take."""
    if args.n_heads % args.n_kv_heads:
        raise ConfigError(f"model.n_kv_heads: n_heads ({args.n_heads}) must be divisible "
                          f"by n_kv_heads ({args.n_kv_heads})")
    family_of(args).check_args(args)
    if seq_len is not None and seq_len > args.max_seq_len:
        raise ConfigError(f"data.seq_len: {seq_len} exceeds the model's max_seq_len "
                          f"({args.max_seq_len}, model.max_seq_len); extend the context "
                          f"first: model.rope_scaling (yarn, linear, llama3) or a larger "
                          f"model.rope_theta, with model.max_seq_len")


_ARG_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim",
               "max_seq_len", "rope_theta", "norm_eps", "tie_embeddings")


# model.<key> -> the args field it sets, where the family's args have it
_FAMILY_FIELDS = {"head_dim": "explicit_head_dim", "sliding_window": "sliding_window",
                  "rotary_dim": "rotary_dim", "n_experts": "n_experts", "top_k": "top_k",
                  "moe_ffn_dim": "moe_ffn_dim"}


def model_args(cfg: JobConfig, base: Optional[Any] = None) -> Any:
    """The model architecture: a preset (or ``base``, e.g. read from config.json) as
    ``model.family``'s variant, with the fields set in ``model.*`` on top."""
    args = base if base is not None else PRESETS[cfg.model.preset]
    if cfg.model.family is not None:
        args = _as_variant(args, cfg.model.family)
    changes = {k: getattr(cfg.model, k) for k in _ARG_FIELDS if getattr(cfg.model, k) is not None}
    changes |= _family_changes(cfg, args)
    changes |= _rope_scaling_changes(cfg, args)
    if "n_heads" in changes and "n_kv_heads" not in changes and args.n_kv_heads == args.n_heads:
        changes["n_kv_heads"] = changes["n_heads"]
    return dataclasses.replace(args, **changes)


def resolve_model_args(cfg: JobConfig, tokenizer_vocab: Optional[int] = None):
    """The model a job trains (``job_model_args``), with every check of it: a shape the
    model cannot have, a sequence or a layout it cannot take, a vocabulary smaller than
    the tokenizer's. Train, ``--dry-run``, estimate and plan call it."""
    args = job_model_args(cfg, tokenizer_vocab)
    check_model_args(args, cfg.data.seq_len)
    check_layout_fits(cfg, args)
    if tokenizer_vocab is not None and tokenizer_vocab > args.vocab_size:
        raise ConfigError(f"model.vocab_size: {args.vocab_size} is smaller than the "
                          f"tokenizer's {tokenizer_vocab} tokens")
    return args


def job_model_args(cfg: JobConfig, tokenizer_vocab: Optional[int] = None):
    """The one place a job's model args are worked out (``resolve_model_args`` adds the
    checks; export reads a finished run's through here unchecked): model.init_from's
    config.json (a ``model.*`` shape field may only repeat it), or the preset with
    ``model.*`` on top, whose vocabulary is the tokenizer's (``tokenizer_vocab``) unless
    model.vocab_size sets it."""
    if cfg.model.init_from:
        base = read_model_args(cfg.model.init_from)
        for name in ("family", "dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size",
                     "ffn_dim", "head_dim", "tie_embeddings", "n_experts", "moe_ffn_dim"):
            value = getattr(cfg.model, name)
            if value is not None and value != getattr(base, name, None):
                raise ConfigError(f"model.{name}: {value} differs from {getattr(base, name)} "
                                  f"in {cfg.model.init_from}/config.json (shapes come from "
                                  "the checkpoint)")
        args = model_args(cfg, base=base)
    else:
        args = model_args(cfg)
        if cfg.model.vocab_size is None and tokenizer_vocab is not None:
            args = dataclasses.replace(args, vocab_size=tokenizer_vocab)
    return args


def _rope_scaling_changes(cfg: JobConfig, args) -> dict:
    """``model.rope_scaling`` as the args' scaling, and the positions it reaches as
    ``max_seq_len`` (unless model.max_seq_len says otherwise)."""
    value = cfg.model.rope_scaling
    if value is None:
        return {}
    parse = family_of(args).rope_scaling
    if parse is None:
        raise ConfigError(f"model.rope_scaling: the {family_of(args).name} family takes its "
                          f"RoPE from its config.json only (Llama, Mistral, Qwen2 and Qwen3 "
                          f"take this override)")
    if not isinstance(value, dict):
        raise ConfigError(f"model.rope_scaling: {value!r} is not a mapping (e.g. {{rope_type: "
                          f"yarn, factor: 4.0, original_max_position_embeddings: 32768}})")
    try:
        scaling = parse(value, "model.rope_scaling", args.max_seq_len)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    changes = {"rope_scaling": scaling}
    if scaling is not None and cfg.model.max_seq_len is None:
        original = (args.max_seq_len if scaling.kind == "linear"
                    else scaling.original_max_position_embeddings)
        changes["max_seq_len"] = max(args.max_seq_len, int(original * scaling.factor))
    return changes


def _as_variant(args, model_type: str):
    family = family_of(args)
    if model_type not in family.model_types:
        raise ConfigError(f"model.family: {model_type!r} is not a variant of the "
                          f"{family.name} family of the model (one of: "
                          f"{', '.join(family.model_types)})")
    return family.as_variant(args, model_type)


def _family_changes(cfg: JobConfig, args) -> dict:
    """The ``model.*`` fields only some families have, refused where ``args`` lacks one."""
    has = {f.name for f in dataclasses.fields(args)}
    changes = {}
    for key, name in _FAMILY_FIELDS.items():
        value = getattr(cfg.model, key)
        if value is None:
            continue
        if name not in has:
            raise ConfigError(f"model.{key}: the {family_of(args).name} family has no "
                              f"{key} (model_type {args.family!r})")
        changes[name] = value
    return changes


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
    check_layout_fits(cfg, args)


def check_layout_fits(cfg: JobConfig, args) -> None:
    """The layout checks that need the model (``config.check_parallel_fits``), and that
    tensor parallelism splits each fused projection into whole groups (``Fused``), so
    every rank holds matching slices of its parts."""
    check_parallel_fits(cfg, args)
    tp = cfg.parallel.tp
    moe = family_of(args).block(args).moe
    if cfg.train.expert_bias_update and (moe is None or moe.router != "sigmoid_group_topk"):
        raise ConfigError(f"train.expert_bias_update: {cfg.train.expert_bias_update} needs "
                          f"routers with a correction bias (DeepSeek-V3's); "
                          f"{args.family}'s have none")
    if cfg.parallel.ep > 1:
        if moe is None:
            raise ConfigError(f"parallel.ep: {cfg.parallel.ep} needs a mixture of experts; "
                              f"{args.family} has none")
        try:
            check_ep(moe.n_experts, cfg.parallel.ep)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if moe is not None:
        # (cp: each rank would balance the experts over its own chunk of the sequences)
        for key, value in (("pp", cfg.parallel.pp), ("cp", cfg.parallel.cp)):
            if value > 1:
                raise ConfigError(f"parallel.{key}: {value} is not supported for a mixture "
                                  f"of experts yet ({args.family}); use FSDP2 "
                                  f"(parallel.dp_shard, parallel.dp_replicate)")
    if family_of(args).block(args).linear_layers:
        # (a Gated DeltaNet's state runs through the whole sequence; tensor parallelism
        # splits its heads, as the fused check below requires)
        for key, value in (("pp", cfg.parallel.pp), ("cp", cfg.parallel.cp)):
            if value > 1:
                raise ConfigError(f"parallel.{key}: {value} is not supported for a model "
                                  f"with linear-attention layers yet ({args.family}); use "
                                  f"FSDP2 (parallel.dp_shard, parallel.dp_replicate)")
    for name, fused in family_of(args).block(args).fused.items():
        if fused.groups % tp:
            parts = ", ".join(part for part, _ in fused.parts)
            raise ConfigError(f"parallel.tp: {tp} must divide the {fused.groups} groups of "
                              f"the fused {name} ({parts}), so that each rank holds whole "
                              f"groups")
