"""What a resume may change: a checkpoint continues one model and one objective.

A resumed run loads the checkpoint's weights, optimizer state and data position into the
model the new config builds, on any layout. The model (its resolved shape, family, head
split, vocabulary, RoPE, LoRA adapters), the objective with the keys its loss reads (GRPO:
also its sampling and its rewards, ``config.rl.LOSS_KEYS``), and the seed (the data
order) must be the checkpoint's: a model with fewer layers would load a prefix of them,
more heads would re-split the same matrices, another loss would mix two objectives in
one run's metrics. ``check_resume`` refuses those before any compute, naming each key
with both values. The model is compared as resolved (presets,
``model.init_from``'s config.json, the tokenizer's vocabulary), against what the
checkpoint's ``meta.json`` recorded, so a shape spelled another way is the same model.

Everything else is an intended change (data, learning rate, steps, layout, logging,
checkpoint cadence, paths): ``check_resume`` returns one plain line per changed key for
the run to print. Paths are compared absolute (as a run makes them at start), so one
spelled relative in an older checkpoint's config.yaml is not a change.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Optional

from lmforge.checkpoint import (CheckpointError, latest_checkpoint, read_job_config, read_meta,
                                resume_is_auto)
from lmforge.config import OBJECTIVE_KEYS, ConfigError, JobConfig, objective_name, show
from lmforge.config.errors import show_name
from lmforge.config.keys import RL_OBJECTIVES
from lmforge.config.paths import with_absolute_paths
from lmforge.config.rl import LOSS_KEYS as RL_LOSS_KEYS
from lmforge.config.rl import comparable_rewards
from lmforge.data.tokenizer import load_tokenizer
from lmforge.job import Job
from lmforge.peft.targets import lora_spec
from lmforge.train.run_dir import CHECKPOINTS, resumed_tokenizer

# Model args that neither shape the weights nor change what they compute: announced.
FREE_MODEL_ARGS = ("max_seq_len", "init_std")
# The model section's keys that resolve into the model args (compared as resolved).
MODEL_ARG_KEYS = ("preset", "dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size",
                  "ffn_dim", "max_seq_len", "rope_theta", "norm_eps", "tie_embeddings",
                  "family", "head_dim", "sliding_window", "rotary_dim", "rope_scaling")
# What the adapters are: their shapes, where they sit, their scale, the base's storage.
LORA_KEYS = ("enabled", "rank", "alpha", "rslora", "targets", "quantize")
# Settings that choose how a loss is computed, not what it is (a precomputed reference
# holds the values a live one would give): announced like any intended change.
NOT_LOSS_KEYS = ("train.reference",)
# How or where this invocation runs, not what the run is (a run directory may move):
# never announced.
INVOCATION_KEYS = ("train.resume", "train.stop_at_step", "train.progress_bar",
                   "train.overwrite", "train.output_dir")
_LONGEST_VALUE = 60  # characters of a value shown in a message


def resume_checkpoint(cfg: JobConfig) -> Optional[Path]:
    """The checkpoint ``train.resume`` continues: the path, or (auto) the newest complete
    one in the run's checkpoints (which the run loads unless it fails verification);
    None for a fresh run."""
    resume = cfg.train.resume
    if not resume or not str(resume).strip():
        return None
    if resume_is_auto(resume):
        return latest_checkpoint(Path(cfg.train.output_dir) / CHECKPOINTS)
    return Path(resume)


def resume_changes(job: Job) -> list[str]:
    """Before any set-up: ``check_resume`` against the checkpoint the run would continue;
    no lines for a fresh run."""
    checkpoint = resume_checkpoint(job.config)
    if checkpoint is None:
        return []
    m = job.config.model
    vocab_known = bool(m.tokenizer or m.init_from or m.vocab_size is not None)
    saved = resumed_tokenizer(job.config)
    if saved is not None:  # the corpus tokenizer the run reuses sizes its vocabulary
        job, vocab_known = job.with_tokenizer(load_tokenizer(saved).vocab_size), True
    return check_resume(job, checkpoint, vocab_known)


def check_resume(job: Job, checkpoint: Path, vocab_known: bool = True) -> list[str]:
    """Refuses (``ConfigError``, one line naming every key at fault) a ``job`` that
    cannot continue ``checkpoint``; returns the announcement of each intended change.
    ``vocab_known``: False while the run's tokenizer is still to be trained (its size is
    compared once it is)."""
    saved = _saved_config(checkpoint)
    saved_args, args = _saved_args(checkpoint), _args_dict(job.args)
    refused = (_model_differences(saved_args, args,
                                  skip=() if vocab_known else ("vocab_size",))
               + _lora_differences(saved, job) + _objective_differences(saved, job)
               + _differences({"train.seed": saved.train.seed},
                              {"train.seed": job.config.train.seed}))
    if refused:
        clauses = "; ".join(f"{key} is {_show(old)} in the checkpoint {checkpoint.name} "
                            f"but {_show(new)} now" for key, old, new in refused)
        raise ConfigError(
            f"train.resume: {clauses}; a resume continues the checkpoint's model, "
            f"objective and data order: set them back, or start a fresh run in another "
            f"train.output_dir")
    return [f"resume: {key} changed from {_show(old)} to {_show(new)} "
            f"(checkpoint {checkpoint.name})"
            for key, old, new in _intended(saved, job) + _free_differences(saved_args, args)]


def _saved_config(checkpoint: Path) -> JobConfig:
    try:
        return read_job_config(checkpoint)
    except CheckpointError as e:
        raise ConfigError(f"train.resume: {e}") from None


def _saved_args(checkpoint: Path) -> Optional[dict]:
    """The model args the checkpoint's run built (None: saved without them)."""
    try:
        args = read_meta(checkpoint).get("model_args")
    except CheckpointError as e:
        raise ConfigError(f"train.resume: {e}") from None
    return _normalized(args) if isinstance(args, dict) else None


def _args_dict(args: Any) -> dict:
    return _normalized(dataclasses.asdict(args))


def _normalized(args: dict) -> dict:
    """As meta.json holds them (JSON types), with the head size as the model has it: an
    explicit head_dim equal to dim / n_heads is the same model."""
    args = json.loads(json.dumps(args))
    if "explicit_head_dim" in args:
        explicit = args.pop("explicit_head_dim")
        args["head_dim"] = explicit or args["dim"] // args["n_heads"]
    return args


def _model_differences(saved: Optional[dict], now: dict, skip=()) -> list[tuple]:
    if saved is None:
        return []
    shape = {k: v for k, v in saved.items() if k not in FREE_MODEL_ARGS + tuple(skip)}
    return _differences({f"model.{k}": v for k, v in shape.items()},
                        {f"model.{k}": now.get(k) for k in shape})


def _lora_differences(saved: JobConfig, job: Job) -> list[tuple]:
    def section(cfg: JobConfig) -> dict:
        if not cfg.lora.enabled:
            return {"lora.enabled": False}
        try:
            spec = lora_spec(cfg, job.family.projections)
        except ConfigError:  # another family's names: the family's difference says it
            return {}
        values = {k: getattr(cfg.lora, k) for k in LORA_KEYS}
        values.update(targets=list(spec.targets), quantize=spec.quantize)
        return {f"lora.{k}": v for k, v in values.items()}
    return _differences(section(saved), section(job.config))


def _objective_differences(saved: JobConfig, job: Job) -> list[tuple]:
    before, now = objective_name(saved), job.objective
    if before != now:
        return [("train.objective", before, now)]
    keys = loss_keys(now)
    return _differences(_flat(saved, keys), _flat(job.config, keys))


def loss_keys(objective: str) -> list[str]:
    """The keys ``objective``'s loss reads (``config.OBJECTIVE_KEYS``, defined once; for
    GRPO, with its sampling and rewards: ``config.rl.LOSS_KEYS``)."""
    return [key for key, users in OBJECTIVE_KEYS.items()
            if objective in users and key not in NOT_LOSS_KEYS] + \
        (list(RL_LOSS_KEYS) if objective in RL_OBJECTIVES else [])


def _intended(saved: JobConfig, job: Job) -> list[tuple]:
    """Every other key of the config that changed."""
    compared = {*INVOCATION_KEYS, *(f"model.{k}" for k in MODEL_ARG_KEYS),
                *(f"lora.{k}" for k in LORA_KEYS), "train.objective", "train.seed",
                *loss_keys(job.objective)}
    before, now = _flat(saved), _flat(job.config)
    return _differences({k: v for k, v in before.items() if k not in compared},
                        {k: v for k, v in now.items() if k not in compared})


def _free_differences(saved: Optional[dict], now: dict) -> list[tuple]:
    if saved is None:
        return []
    return _differences({f"model.{k}": saved.get(k) for k in FREE_MODEL_ARGS},
                        {f"model.{k}": now.get(k) for k in FREE_MODEL_ARGS})


def _flat(cfg: JobConfig, keys=None) -> dict:
    """``cfg``'s keys as comparable values: its paths absolute (as a run makes them at
    start; a checkpoint's config.yaml may hold them as given) and its rewards as lists."""
    flat = comparable_rewards({f"{section}.{key}": value
                               for section, values in with_absolute_paths(cfg).to_dict().items()
                               for key, value in values.items()})
    return flat if keys is None else {k: flat[k] for k in keys}


def _differences(before: dict, now: dict) -> list[tuple]:
    """(key, before, now) for each key whose values differ, in key order."""
    return [(k, before.get(k), now.get(k)) for k in sorted(set(before) | set(now))
            if _comparable(before.get(k)) != _comparable(now.get(k))]


def _comparable(value: Any) -> Any:
    """A value as YAML and JSON round-trip it (a tuple and a list are the same)."""
    return json.loads(json.dumps(value, default=str))


def _show(value: Any) -> str:
    """A value for a message, as YAML writes it (null, true, [a, b]), never unbounded."""
    if isinstance(value, str):
        return show_name(value, _LONGEST_VALUE)
    short = show(value, _LONGEST_VALUE)
    if short.endswith("..."):  # long: cut without writing all of it out
        return short
    return json.dumps(value, default=str).replace('"', "")
