"""``validate()``: a config refused before any model is built or data is read, every
error naming the field at fault, so a bad config costs a second, not a queued GPU job.
Each key's own choices and range are declared beside it (``schema.py``, ``keys.key``);
the rules here are those between keys."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

from lmforge.config.derived import pipeline_microbatches, resolve_layout
from lmforge.config.errors import ConfigError
from lmforge.config.keys import PREFERENCE_OBJECTIVES, allowed, config_keys


def validate(cfg: "JobConfig", world_size: int = 1, distributed: Optional[bool] = None) -> None:
    """Refuse a bad config before any compute; every message names the field.
    ``distributed``: see ``parallel.mesh.runs_distributed`` (default: several processes)."""
    distributed = world_size > 1 if distributed is None else distributed
    for dotted, f, value in config_keys(cfg):
        if isinstance(value, float) and not math.isfinite(value):
            # inf passes every "> 0" bound and nan fails them with a puzzling message;
            # either would only show up as a non-finite loss a step or two into the run
            raise ConfigError(f"{dotted}: {value} is not a finite number")
        problem = allowed(f, value)
        if problem:
            raise ConfigError(f"{dotted}: {problem}")
    if cfg.data.kind in ("text", "pretrain", "sft", "preference") and not cfg.data.path:
        raise ConfigError(f"data.path: required when data.kind is {cfg.data.kind}")
    if cfg.train.overwrite and cfg.train.resume:
        raise ConfigError("train.overwrite: cannot be combined with train.resume (one starts "
                          "over, the other continues)")
    _validate_preference(cfg)
    _validate_cp(cfg)  # (before the layout's sizes: why a cp layout cannot run comes first)
    _validate_batch(cfg, world_size)
    _validate_grouping(cfg.data)
    _validate_in_backward(cfg, world_size, distributed)
    _validate_lora(cfg.lora)
    _validate_harness(cfg.eval)
    tracker_names(cfg.metrics.tracker)  # (a name it does not know: refused here)
    if cfg.lora.enabled and cfg.parallel.tp > 1:
        raise ConfigError("parallel.tp: LoRA under tensor parallelism is not supported yet "
                          "(use data parallelism / FSDP2 for LoRA)")
    if cfg.lora.quantize and distributed:
        raise ConfigError("lora.quantize: quantized (QLoRA) bases train in one plain process "
                          "(no FSDP2)")
    if cfg.train.loss_chunk_tokens and (cfg.parallel.tp > 1 or cfg.parallel.pp > 1):
        # tp: the vocab-parallel loss already splits the logits tp ways; pp: the last
        # stage's schedule owns the loss
        raise ConfigError("train.loss_chunk_tokens: supported with data parallelism / FSDP "
                          "only (set it to 0 with parallel.tp > 1 or parallel.pp > 1)")


def _validate_batch(cfg: "JobConfig", world_size: int) -> None:
    layout = resolve_layout(cfg.parallel, world_size)
    dp_size = layout["dp_replicate"] * layout["dp_shard"]
    per_step = cfg.data.micro_batch_size * dp_size
    gbs = cfg.data.global_batch_size
    if gbs is not None and (gbs <= 0 or gbs % per_step):
        raise ConfigError(f"data.global_batch_size: {gbs} must be a positive multiple of "
                          f"micro_batch_size x data-parallel size = {per_step}")
    if cfg.parallel.pp > 1:
        pipeline_microbatches(cfg, dp_size)  # raises when the batch cannot be split


def _validate_grouping(data: "DataConfig") -> None:
    if not data.group_by_length:
        return
    if data.kind != "sft":
        raise ConfigError(f"data.group_by_length: only SFT samples vary in length (data.kind "
                          f"is {data.kind}; its rows are all data.seq_len long)")
    if data.pack:
        raise ConfigError("data.group_by_length: cannot be combined with data.pack=true "
                          "(packing already removes the padding); set one of them")


def _validate_in_backward(cfg: "JobConfig", world_size: int, distributed: bool) -> None:
    if cfg.train.param_dtype == "bf16" and (distributed or cfg.train.dtype == "fp16"):
        raise ConfigError("train.param_dtype: bf16 weights are for one process computing in "
                          "bf16 (FSDP2 keeps fp32 shards, fp16 keeps fp32 master weights)")
    if not cfg.optim.in_backward:
        return
    # The update happens in backward, before the step's total gradient (or fp16 overflow) is known.
    if cfg.train.dtype == "fp16":
        raise ConfigError("optim.in_backward: cannot be combined with train.dtype=fp16 (a "
                          "step whose gradients overflow must be skipped whole)")
    if cfg.optim.grad_clip:
        raise ConfigError("optim.grad_clip: must be 0 with optim.in_backward (the total "
                          "gradient norm is not known when each parameter is updated)")
    gbs = cfg.data.global_batch_size
    if gbs is not None and gbs != cfg.data.micro_batch_size * world_size:
        raise ConfigError("data.global_batch_size: gradient accumulation is impossible "
                          "with optim.in_backward (each backward updates the weights)")
    if distributed:
        raise ConfigError("optim.in_backward: supported in a single plain process only")
    if cfg.train.on_nonfinite != "stop":
        raise ConfigError("train.on_nonfinite: skip cannot undo an update made in "
                          "backward; use stop with optim.in_backward")


def _validate_lora(lora: "LoraConfig") -> None:
    # lora.targets is checked by its one rule, lmforge.peft.targets.resolve_targets, which
    # the trainer and the estimate call right after validate(), before any compute.
    if lora.quantize and not lora.enabled:
        raise ConfigError("lora.quantize: a quantized base trains nothing without adapters "
                          "(set lora.enabled=true)")
    if lora.adapter_from is not None:
        if not lora.enabled:
            raise ConfigError("lora.adapter_from: set lora.enabled=true to load an adapter")
        if not (Path(lora.adapter_from) / "adapter_config.json").is_file():
            raise ConfigError(f"lora.adapter_from: {lora.adapter_from} has no "
                              f"adapter_config.json (a PEFT adapter directory)")


def _validate_cp(cfg: "JobConfig") -> None:
    """What context parallelism does not run with yet, each refusal saying why."""
    cp = cfg.parallel.cp
    if cp == 1:
        return
    if cfg.parallel.pp > 1:
        raise ConfigError("parallel.cp: not combined with parallel.pp yet (each stage's "
                          "attention would gather K/V inside the pipeline schedule)")
    if cfg.data.kind == "preference":
        raise ConfigError("parallel.cp: the preference objectives need each sequence's "
                          "whole log-probability on one rank; use parallel.dp_shard")
    if cfg.model.attention == "flex":
        raise ConfigError("parallel.cp: gathers K/V and applies a dense mask per rank; "
                          "model.attention=flex is not combined with it yet (use sdpa)")
    if cfg.data.seq_len % (2 * cp):
        raise ConfigError(f"data.seq_len: {cfg.data.seq_len} must be a multiple of 2 x "
                          f"parallel.cp = {2 * cp} (each rank holds two chunks of every "
                          f"sequence)")


def _validate_harness(ev: "EvalConfig") -> None:
    """The task names' shape and the folder; that each task exists is checked against
    lm-eval's registry before training (``eval.harness.check_tasks``)."""
    tasks = harness_task_names(ev.harness_tasks)
    if ev.harness_include_path is not None and not Path(ev.harness_include_path).is_dir():
        raise ConfigError(f"eval.harness_include_path: {ev.harness_include_path} is not a "
                          f"directory")
    if ev.harness_include_path is not None and not tasks:
        raise ConfigError("eval.harness_include_path: set eval.harness_tasks to run its tasks")


TRACKERS = ("tensorboard", "mlflow", "wandb")


def tracker_names(value) -> list[str]:
    """``metrics.tracker`` as a list of tracker names (a list, names separated by commas,
    or none), each once and known, in the order given."""
    if value is None or value == "none":
        return []
    if isinstance(value, str):
        value = value.split(",")
    if not isinstance(value, (list, tuple)) or not all(isinstance(t, str) for t in value):
        raise ConfigError(f"metrics.tracker: {value!r} is not a list of tracker names")
    names = list(dict.fromkeys(t.strip() for t in value if t.strip()))
    unknown = [t for t in names if t not in TRACKERS]
    if unknown:
        raise ConfigError(f"metrics.tracker: {', '.join(unknown)} is not one of "
                          f"{', '.join(TRACKERS)}")
    return names


def harness_task_names(value) -> list[str]:
    """``eval.harness_tasks`` as a list of names (a list, or names separated by commas)."""
    if value is None:
        return []
    if isinstance(value, str):
        value = value.split(",")
    if not isinstance(value, (list, tuple)) or not all(isinstance(t, str) for t in value):
        raise ConfigError(f"eval.harness_tasks: {value!r} is not a list of task names")
    return [t.strip() for t in value if t.strip()]


def _validate_preference(cfg: "JobConfig") -> None:
    """A preference objective needs pairs, and pairs a preference objective; the
    layouts it does not run in yet are refused, saying why."""
    objective, kind = cfg.train.objective, cfg.data.kind
    pairs = objective in PREFERENCE_OBJECTIVES
    if pairs and kind != "preference":
        raise ConfigError(f"train.objective: {objective} compares chosen and rejected "
                          f"completions; it needs data.kind=preference (data.kind is {kind})")
    if kind == "preference" and objective == "next_token":
        raise ConfigError("train.objective: next_token does not train on preference pairs; "
                          f"use one of {', '.join(PREFERENCE_OBJECTIVES)} (or auto: dpo)")
    if kind != "preference":
        return
    if cfg.parallel.pp > 1:
        # a pipeline's last stage sees one microbatch's logits at a time, while a pair's
        # loss needs both its sequences and the reference's pass through every stage
        raise ConfigError("parallel.pp: the preference objectives do not run in a pipeline "
                          "(use parallel.dp_shard and parallel.tp)")
