"""The facts derived from a config (resolved layout, batch arithmetic, compute dtype,
device) and the layout checks that need the model's shape: each defined once, read by
the trainer, the estimate, the planner and the launcher alike."""
from __future__ import annotations

from typing import Optional

from lmforge.config.errors import ConfigError, show
from lmforge.config.keys import DEVICES


def check_parallel_fits(cfg: JobConfig, args) -> None:
    """Layout checks that need the model shape; run before any process group work."""
    p = cfg.parallel
    if args.n_heads % p.tp or args.n_kv_heads % p.tp:
        raise ConfigError(f"parallel.tp: {p.tp} must divide n_heads ({args.n_heads}) and "
                          f"n_kv_heads ({args.n_kv_heads}); kv heads are not replicated")
    if p.pp_schedule == "interleaved_1f1b" and p.pp > 1 and p.pp_virtual_stages < 2:
        raise ConfigError("parallel.pp_virtual_stages: interleaved_1f1b needs >= 2 stages "
                          "per rank")
    if p.pp_schedule != "interleaved_1f1b" and p.pp_virtual_stages != 1:
        raise ConfigError(f"parallel.pp_virtual_stages: only interleaved_1f1b uses virtual "
                          f"stages (pp_schedule is {p.pp_schedule})")
    if p.pp > 1:
        n_stages = p.pp * p.pp_virtual_stages
        if args.n_layers % n_stages:
            raise ConfigError(f"parallel.pp: {args.n_layers} layers do not split evenly into "
                              f"{n_stages} stages (pp x pp_virtual_stages)")
        if cfg.data.document_mask or cfg.data.pack:
            raise ConfigError("parallel.pp: document masking / SFT packing is not supported "
                              "with pipeline parallelism yet")


def resolve_device(name: str, field: str = "train.device", local_rank: int = 0):
    """The torch device ``auto`` | ``cpu`` | ``cuda`` means on this machine (auto: the GPU
    when one is visible); ``field`` names the setting in the error when none is."""
    import torch  # config is read by tools that never touch a tensor; torch loads on use

    if name not in DEVICES:
        raise ConfigError(f"{field}: {show(name)} is not one of {', '.join(DEVICES)}")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{field}: cuda requested but no GPU is visible")
    use_cuda = name == "cuda" or (name == "auto" and torch.cuda.is_available())
    return torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")


# ---------------------------------------------------------------------- derived facts

def resolve_layout(p: ParallelConfig, world_size: int) -> dict[str, int]:
    """The size of each mesh dimension, outermost first (pp, dp_replicate, dp_shard, cp,
    tp), with ``dp_shard=-1`` resolved to what is left of ``world_size`` (the product)."""
    rest = world_size // (p.dp_replicate * p.cp * p.tp * p.pp) if world_size else 0
    dp_shard = rest if p.dp_shard == -1 else p.dp_shard
    if dp_shard < 1 or p.dp_replicate * dp_shard * p.cp * p.tp * p.pp != world_size:
        raise ConfigError(
            f"parallel.dp_shard: dp_replicate({p.dp_replicate}) x dp_shard({p.dp_shard}) x "
            f"cp({p.cp}) x tp({p.tp}) x pp({p.pp}) must equal the world size {world_size}")
    return {"pp": p.pp, "dp_replicate": p.dp_replicate, "dp_shard": dp_shard, "cp": p.cp,
            "tp": p.tp}


def samples_per_step(cfg: JobConfig, dp_size: int) -> int:
    """Sequences per optimizer step over all data-parallel ranks: data.global_batch_size,
    else one micro-batch per rank."""
    return cfg.data.global_batch_size or cfg.data.micro_batch_size * dp_size


def grad_accumulation_steps(cfg: JobConfig, dp_size: int) -> int:
    """Micro-batches each rank runs per optimizer step (with pp > 1, concatenated and
    split again into ``pipeline_microbatches``)."""
    return samples_per_step(cfg, dp_size) // (cfg.data.micro_batch_size * dp_size)


def pipeline_microbatches(cfg: JobConfig, dp_size: int) -> int:
    """Pieces the pipeline schedule splits each rank's sequences of a step into (pp > 1):
    ``parallel.microbatches``, else the smallest count that divides them and is at least
    both the gradient accumulation steps and ``parallel.pp`` (a multiple of pp for
    interleaved_1f1b), so that every stage has work while the pipeline is full."""
    p = cfg.parallel
    sequences = samples_per_step(cfg, dp_size) // dp_size  # this rank's, per step
    if p.microbatches:
        problem = _microbatch_problem(p, p.microbatches, sequences)
        if problem:
            raise ConfigError(f"parallel.microbatches: {p.microbatches} {problem}")
        return p.microbatches
    start = max(grad_accumulation_steps(cfg, dp_size), p.pp)
    for count in range(start, sequences + 1):
        if not _microbatch_problem(p, count, sequences):
            return count
    raise ConfigError(
        f"data.micro_batch_size: each rank runs {sequences} sequence(s) per step, too few "
        f"to split into the pipeline microbatches parallel.pp={p.pp} needs "
        f"({'a multiple of' if p.pp_schedule == 'interleaved_1f1b' else 'at least'} {p.pp}); "
        f"raise data.micro_batch_size or data.global_batch_size")


def _microbatch_problem(p: ParallelConfig, count: int, sequences: int) -> Optional[str]:
    """Why ``count`` pipeline microbatches do not fit (None: they do)."""
    if sequences % count:
        return f"does not divide the {sequences} sequences each rank runs per step"
    if p.pp_schedule == "1f1b" and count < p.pp:
        return f"is fewer than the {p.pp} pipeline stages 1f1b needs (parallel.pp)"
    if p.pp_schedule == "interleaved_1f1b" and count % p.pp:
        return f"is not a multiple of parallel.pp={p.pp} (interleaved_1f1b)"
    return None


def objective_name(cfg: JobConfig) -> str:
    """What a step minimises: train.objective, where auto is dpo for preference pairs,
    grpo for prompts and the next-token loss for every other data kind."""
    if cfg.train.objective != "auto":
        return cfg.train.objective
    return {"preference": "dpo", "prompts": "grpo"}.get(cfg.data.kind, "next_token")


def compute_dtype(cfg: JobConfig, device_type: str) -> str:
    """bf16 | fp16 | fp32: what the model computes in; train.dtype=auto is bf16 on a GPU
    with bf16 arithmetic, fp16 (with loss scaling) on an older one (V100, T4), fp32 on
    the CPU."""
    if cfg.train.dtype != "auto":
        return cfg.train.dtype
    if device_type != "cuda":
        return "fp32"
    return "bf16" if _cuda_has_bf16() else "fp16"


def _cuda_has_bf16() -> bool:
    import torch  # config is read by tools that never touch a tensor; torch loads on use

    # No GPU here (an estimate for one): assume a current GPU. Emulated bf16 (V100) does
    # not count: it runs at a fraction of fp16's speed.
    return (not torch.cuda.is_available()
            or torch.cuda.is_bf16_supported(including_emulation=False))
