"""``validate()``: a config refused before any model is built or data is read, every
error naming the field at fault, so a bad config costs a second, not a queued GPU job.
Each key's own choices and range are declared beside it (``schema.py``, ``keys.key``);
the rules here are those between keys."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Collection, Optional

from lmforge.config.derived import objective_name, pipeline_microbatches, resolve_layout
from lmforge.config.errors import ConfigError, show, show_name
from lmforge.config.keys import (AUTO, OBJECTIVE_KEYS, PREFERENCE_OBJECTIVES, RL_OBJECTIVES,
                                 allowed, config_keys, mapping_problem)
from lmforge.config.rl import rl_key_users, validate_rl


def validate(cfg: "JobConfig", world_size: int = 1, distributed: Optional[bool] = None) -> None:
    """Refuse a bad config before any compute; every message names the field.
    ``distributed``: see ``parallel.mesh.runs_distributed`` (default: several processes)."""
    distributed = world_size > 1 if distributed is None else distributed
    _check_each_key(cfg)
    if cfg.data.kind in ("text", "pretrain", "sft", "preference", "prompts") \
            and not cfg.data.path:
        raise ConfigError(f"data.path: required when data.kind is {cfg.data.kind}")
    if cfg.train.overwrite and cfg.train.resume:
        raise ConfigError("train.overwrite: cannot be combined with train.resume (one starts "
                          "over, the other continues)")
    _validate_preference(cfg)
    validate_rl(cfg, world_size)
    _validate_cp(cfg)  # (before the layout's sizes: why a cp layout cannot run comes first)
    _validate_batch(cfg, world_size)
    _validate_ep(cfg, world_size)
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
    for name, off in (("loss_chunk_tokens", "0"), ("fused_loss", "false")):
        # the head run in chunks: tp's vocab-parallel loss already splits the logits tp
        # ways; pp: the last stage's schedule owns the loss
        if getattr(cfg.train, name) and (cfg.parallel.tp > 1 or cfg.parallel.pp > 1):
            raise ConfigError(f"train.{name}: supported with data parallelism / FSDP only "
                              f"(set it to {off} with parallel.tp > 1 or parallel.pp > 1)")


def _check_each_key(cfg: "JobConfig") -> None:
    """Each key's own value: finite, its choices and bound, a mapping's keys, paths."""
    for dotted, f, value in config_keys(cfg):
        problem = _value_problem(dotted, f, value)
        if problem:
            raise ConfigError(problem)
    for dotted in ("data.path", "data.eval_path"):
        _check_paths(dotted, getattr(cfg.data, dotted.split(".")[1]))


def _value_problem(dotted: str, f, value) -> Optional[str]:
    """Why one key's value is refused whatever the other keys hold (None: it is not)."""
    if isinstance(value, float) and not math.isfinite(value):
        # inf passes every "> 0" bound and nan fails them with a puzzling message;
        # either would only show up as a non-finite loss a step or two into the run
        return f"{dotted}: {value} is not a finite number"
    problem = allowed(f, value)
    return f"{dotted}: {problem}" if problem else mapping_problem(dotted, f, value)


def _validate_batch(cfg: "JobConfig", world_size: int) -> None:
    layout = resolve_layout(cfg.parallel, world_size)
    dp_size = layout["dp_replicate"] * layout["dp_shard"]
    gbs = cfg.data.global_batch_size
    if cfg.data.micro_batch_size == AUTO:  # sized by perf/auto_batch.py, then checked below
        if gbs is not None and (gbs <= 0 or gbs % dp_size):
            raise ConfigError(f"data.global_batch_size: {gbs} must be a positive multiple of "
                              f"the data-parallel size {dp_size} (data.micro_batch_size=auto "
                              f"divides each rank's share)")
        return
    per_step = cfg.data.micro_batch_size * dp_size
    if gbs is not None and (gbs <= 0 or gbs % per_step):
        raise ConfigError(f"data.global_batch_size: {gbs} must be a positive multiple of "
                          f"micro_batch_size x data-parallel size = {per_step}")
    if cfg.parallel.pp > 1:
        pipeline_microbatches(cfg, dp_size)  # raises when the batch cannot be split


def _validate_ep(cfg: "JobConfig", world_size: int) -> None:
    """Expert parallelism takes its ranks out of dp_shard (``parallel.mesh``): ep must
    divide it; with HSDP and tensor parallelism it composes, with pipeline and context
    parallelism not (an MoE takes neither yet). The model's part (its experts) is in
    ``models.presets.check_layout_fits``."""
    p = cfg.parallel
    if p.ep == 1:
        return
    dp_shard = resolve_layout(p, world_size)["dp_shard"]
    if dp_shard % p.ep:
        raise ConfigError(f"parallel.ep: {p.ep} does not divide parallel.dp_shard "
                          f"({dp_shard}); the expert-parallel ranks come out of the "
                          f"FSDP ranks")
    for name in ("pp", "cp"):
        if getattr(p, name) > 1:
            raise ConfigError(f"parallel.ep: {p.ep} with parallel.{name}="
                              f"{getattr(p, name)} is not supported (a mixture of experts "
                              f"takes no pipeline or context parallelism yet)")


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
    if gbs is not None and cfg.data.micro_batch_size != AUTO \
            and gbs != cfg.data.micro_batch_size * world_size:
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
        raise ConfigError(f"metrics.tracker: {show(value)} is not a list of tracker names")
    names = list(dict.fromkeys(t.strip() for t in value if t.strip()))
    unknown = [t for t in names if t not in TRACKERS]
    if unknown:
        raise ConfigError(f"metrics.tracker: {show_name(', '.join(unknown))} is not one of "
                          f"{', '.join(TRACKERS)}")
    return names


def harness_task_names(value) -> list[str]:
    """``eval.harness_tasks`` as a list of names (a list, or names separated by commas)."""
    if value is None:
        return []
    if isinstance(value, str):
        value = value.split(",")
    if not isinstance(value, (list, tuple)) or not all(isinstance(t, str) for t in value):
        raise ConfigError(f"eval.harness_tasks: {show(value)} is not a list of task names")
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


def _check_paths(dotted: str, value) -> None:
    """data.path / data.eval_path: a path, or a list of paths (typed Any for the list)."""
    if value is None or isinstance(value, str):
        return
    if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
        raise ConfigError(f"{dotted}: {show(value)} is not a path or a list of paths")


def refuse_ignored(cfg: "JobConfig", explicit: Collection[str] = ()) -> None:
    """A key set (away from its default) on a run that does not use it: refused, naming
    what does use it, since a setting that silently changes nothing is a wrong result
    found late (ORPO has no label smoothing, SimPO no reference). ``load_config`` calls
    it on the config a user wrote, not ``validate``: the estimate and plan vary keys of
    a valid config (full checkpointing, one stage) and leave the ones that then idle.
    A value ``validate`` refuses (an unknown objective, tracker) is left to it.
    ``explicit``: the keys the user set (lora.enabled=false set on a LoRA recipe turns
    LoRA off knowingly; lora.rank without lora.enabled is a forgotten switch)."""
    changed = {dotted: (f, value) for dotted, f, value in config_keys(cfg)
               if value != f.default}
    for dotted, users, unused_by in _key_users(cfg, "lora.enabled" in explicit):
        if unused_by is not None and dotted in changed:
            scope = f" (it applies to {users})" if users else ""
            raise ConfigError(_value_problem(dotted, *changed[dotted])
                              or f"{dotted}: {unused_by} does not use it{scope}")


def _key_users(cfg: "JobConfig", lora_switched: bool) -> list[tuple[str, str, Optional[str]]]:
    """(key, what uses it, what this run is where it does not use it, else None)."""
    objective, d, t, p = objective_name(cfg), cfg.data, cfg.train, cfg.parallel
    trackers, tasks = _or_none(tracker_names, cfg.metrics.tracker), \
        _or_none(harness_task_names, cfg.eval.harness_tasks)
    tracking = f"metrics.tracker={','.join(trackers or []) or 'none'}"

    def unless(used: bool, this: str) -> Optional[str]:
        return None if used else this

    rows = []
    if objective in ("next_token", *PREFERENCE_OBJECTIVES, *RL_OBJECTIVES):
        rows += [(k, ", ".join(users), unless(objective in users, objective))
                 for k, users in OBJECTIVE_KEYS.items()]
    rows += rl_key_users(cfg, objective)
    rows.append(("data.max_prompt_len", "data.kind=preference",
                 unless(d.kind == "preference", f"data.kind={d.kind}")))
    rows.append(("data.blend", "data.kind=pretrain",
                 unless(d.kind == "pretrain", f"data.kind={d.kind}")))
    rows.append(("data.pack", "data.kind=sft or preference",  # (the others always pack)
                 unless(d.kind in ("sft", "preference"), f"data.kind={d.kind}")))
    rows += [(f"lora.{k}", "lora.enabled=true",
              unless(cfg.lora.enabled or lora_switched, "lora.enabled=false"))
             for k in ("rank", "alpha", "dropout", "targets", "rslora")]
    if tasks is not None:
        rows += [(f"eval.{k}", "", unless(bool(tasks), "a run without eval.harness_tasks"))
                 for k in ("harness_limit", "harness_num_fewshot", "harness_batch_size")]
    if trackers is not None:
        for name, keys in (("mlflow", ("mlflow_tracking_uri", "mlflow_experiment")),
                           ("wandb", ("wandb_project", "wandb_mode"))):
            rows += [(f"metrics.{k}", f"metrics.tracker with {name}",
                      unless(name in trackers, tracking)) for k in keys]
        rows.append(("metrics.run_name", "metrics.tracker with mlflow or wandb",
                     unless(bool({"mlflow", "wandb"} & set(trackers)), tracking)))
        rows.append(("metrics.tracker_required", "a tracker",
                     unless(bool(trackers), tracking)))
    rows.append(("train.activation_checkpointing_every",
                 "train.activation_checkpointing=selective",
                 unless(t.activation_checkpointing == "selective",
                        f"train.activation_checkpointing={t.activation_checkpointing}")))
    rows += [(f"parallel.{k}", "parallel.pp > 1", unless(p.pp > 1, "parallel.pp=1"))
             for k in ("pp_schedule", "microbatches")]
    return rows


def _or_none(parse, value):
    """``parse(value)``, None where it is refused (``validate`` names that)."""
    try:
        return parse(value)
    except ConfigError:
        return None
