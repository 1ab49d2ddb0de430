"""The worker of tests/distributed/test_estimate_ep.py: a tiny Qwen3-MoE (qwen3-moe-debug's
shape: layer 0 dense, layer 1 16 experts of width 64, top 4) trained by the trainer's own
step (``build_train_model``, ``train_step``), FSDP2 with and without expert parallelism:
over 2 processes dp_shard=2 (ep=2 and none, full training and LoRA on the attention and
the experts), over 4 ep=2 below dp_shard=4 and with HSDP (dp_replicate=2 x dp_shard=2);
TensorMemoryTracker records each rank's peak of live tensor storage over step 2 (step 1
creates the optimizer state), FSDP2's unsharded parameters included (storages it resizes
in place, which no dispatched op shows). Under expert parallelism it also records, per
MoE forward of step 2, the routed rows this rank received as a multiple of its balanced
share (top_k per token of its own micro-batch), from the all-to-all of the counts that
``parallel/expert.py`` sends before the rows: the test estimates at that share, which is
what the estimate's ``EP_IMBALANCE`` allowance stands in for.

``torchrun --nproc-per-node=N estimate_ep.py OUT`` (N = 2 or 4) writes
OUT/peaks-RANK.json: {"peaks": layout -> measured peak bytes, "shares": layout -> the
received shares, one per MoE forward (empty without ep)}, for the layouts of N
processes."""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from lmforge.config import JobConfig
from lmforge.job import resolve
from lmforge.models.registry import PRESETS
from lmforge.parallel import expert
from lmforge.parallel.mesh import build_parallel_dims
from lmforge.perf.tracker import TensorMemoryTracker
from lmforge.train.loop import Runtime, train_step
from lmforge.train.model_setup import build_train_model
from lmforge.train.optim import Optimizers

ARGS = dataclasses.replace(PRESETS["qwen3-moe-debug"], vocab_size=256, max_seq_len=128,
                           router_aux_loss_coef=0.01)
SEQ, MICRO_BATCH, WORLD = 64, 4, 2
LORA = {"lora.enabled": True, "lora.targets": "all-linear", "lora.dropout": 0.0}
LAYOUTS = {"ep2_dp2": {"parallel.dp_shard": 2, "parallel.ep": 2},
           "dp2": {"parallel.dp_shard": 2},
           "ep2_dp2_lora": {"parallel.dp_shard": 2, "parallel.ep": 2, **LORA},
           "dp2_lora": {"parallel.dp_shard": 2, **LORA}}
WORLD_4 = 4
LAYOUTS_4 = {"ep2_dp4": {"parallel.dp_shard": 4, "parallel.ep": 2},
             "ep2_dp2x2": {"parallel.dp_replicate": 2, "parallel.dp_shard": 2,
                           "parallel.ep": 2},
             "ep2_dp4_lora": {"parallel.dp_shard": 4, "parallel.ep": 2, **LORA},
             "dp4": {"parallel.dp_shard": 4}}
BY_WORLD = {WORLD: LAYOUTS, WORLD_4: LAYOUTS_4}


def world_of(layout: str) -> int:
    return WORLD if layout in LAYOUTS else WORLD_4


def job_config(fields: dict, world: int = WORLD) -> JobConfig:
    """The measured run's config (the test's estimate reads the same one)."""
    cfg = JobConfig()
    cfg.data.seq_len, cfg.data.micro_batch_size = SEQ, MICRO_BATCH
    cfg.data.global_batch_size = MICRO_BATCH * world
    cfg.train.device, cfg.train.max_steps = "cpu", 10
    for dotted, value in fields.items():
        section, name = dotted.split(".")
        setattr(getattr(cfg, section), name, value)
    return cfg


@contextlib.contextmanager
def received_shares():
    """Yields a list that gets, per expert-parallel MoE forward, the rows this rank
    received over the rows it routed (its own tokens x top_k: the balanced share). Wraps
    ``expert._exchange_counts``, which the forward looks up by name on each call; sums on
    the host (``tolist``), so the tracker sees no storage of it."""
    shares, exchange = [], expert._exchange_counts

    def recording(counts, group):
        arriving = exchange(counts, group)
        shares.append(sum(arriving.flatten().tolist()) / sum(counts.tolist()))
        return arriving

    expert._exchange_counts = recording
    try:
        yield shares
    finally:
        expert._exchange_counts = exchange


def measure(fields: dict) -> tuple[int, list[float]]:
    """The rank's peak over step 2 and its received shares in that step."""
    world = dist.get_world_size()
    cfg = job_config(fields, world).validate(world_size=world, distributed=True)
    dims = build_parallel_dims(cfg.parallel, world, "cpu")
    job = resolve(cfg, world, distributed=True, args=ARGS)
    rt = Runtime(torch.device("cpu"), contextlib.nullcontext, rank=dist.get_rank(), dims=dims)
    torch.manual_seed(0)
    model = build_train_model(job, rt.device, dims)
    optimizers = Optimizers(model.parts, cfg.optim, cfg.train.max_steps)
    gen = torch.Generator().manual_seed(dist.get_rank())
    ids = torch.randint(0, ARGS.vocab_size, (MICRO_BATCH, SEQ), generator=gen)
    batch = {"input_ids": ids, "labels": ids.clone()}
    train_step(cfg, rt, model, optimizers, [batch], 1)
    tracker = TensorMemoryTracker()
    params = [p for part in model.parts for p in part.parameters()]
    tracker.track(params + [ids, batch["labels"]])
    tracker.track(t for opt in optimizers.optimizers for state in opt.state.values()
                  for t in state.values())
    with received_shares() as shares, tracker:
        train_step(cfg, rt, model, optimizers, [batch], 2)
    del model, optimizers
    gc.collect()
    return tracker.peak, shares


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    layouts = BY_WORLD[dist.get_world_size()]
    runs = {name: measure(fields) for name, fields in layouts.items()}
    result = {"peaks": {name: peak for name, (peak, _) in runs.items()},
              "shares": {name: shares for name, (_, shares) in runs.items()}}
    (out / f"peaks-{dist.get_rank()}.json").write_text(json.dumps(result))
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
