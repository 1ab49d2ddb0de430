"""The worker of tests/distributed/test_estimate_hybrid_tp.py: a tiny Qwen3.5
(qwen3.5-debug: three Gated DeltaNet layers of 2 key and 4 value heads, then a gated
full-attention one; vocab 256) trained by the trainer's own step (``build_train_model``,
``train_step``) over 2 processes at parallel.tp=2, each rank holding one key head of
every linear layer with its two value heads (``models.tp.linear_attention_plan``), with
and without sequence parallelism, full fine-tuning in fp32 and under bf16 autocast, and
with full activation checkpointing; TensorMemoryTracker records each rank's peak of live
tensor storage over step 2 (step 1 creates the optimizer state). Both ranks read the same
rows, as a tensor-parallel group does.

``torchrun --nproc-per-node=2 estimate_hybrid_tp.py OUT`` writes OUT/peaks-RANK.json:
layout -> measured peak bytes."""
from __future__ import annotations

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
from lmforge.parallel.mesh import build_parallel_dims
from lmforge.perf.tracker import TensorMemoryTracker
from lmforge.train.loop import Runtime, train_step
from lmforge.train.model_setup import build_train_model
from lmforge.train.optim import Optimizers
from lmforge.train.precision import mixed_precision

ARGS = dataclasses.replace(PRESETS["qwen3.5-debug"], vocab_size=256, max_seq_len=128)
SEQ, MICRO_BATCH, WORLD = 128, 2, 2  # (two chunks of the delta rule per row)
TP = {"parallel.tp": 2, "parallel.sequence_parallel": False}
SP = {"parallel.tp": 2, "parallel.sequence_parallel": True}
BF16, FULL = {"train.dtype": "bf16"}, {"train.activation_checkpointing": "full"}
LAYOUTS = {"tp2": TP, "tp2_sp": SP, "tp2_bf16": {**TP, **BF16},
           "tp2_sp_bf16": {**SP, **BF16}, "tp2_full": {**TP, **FULL},
           "tp2_sp_full": {**SP, **FULL}, "tp2_sp_bf16_full": {**SP, **BF16, **FULL}}


def job_config(fields: dict) -> JobConfig:
    """The measured run's config (the test's estimate reads the same one): tp=2 is the
    whole world, so one data-parallel rank and one micro-batch per step."""
    cfg = JobConfig()
    cfg.data.seq_len, cfg.data.micro_batch_size = SEQ, MICRO_BATCH
    cfg.data.global_batch_size = MICRO_BATCH
    cfg.train.device, cfg.train.max_steps = "cpu", 10
    for dotted, value in fields.items():
        section, name = dotted.split(".")
        setattr(getattr(cfg, section), name, value)
    return cfg


def measure(fields: dict) -> int:
    cfg = job_config(fields).validate(world_size=WORLD, distributed=True)
    dims = build_parallel_dims(cfg.parallel, WORLD, "cpu")
    job = resolve(cfg, WORLD, distributed=True, args=ARGS)
    autocast, param_dtype = mixed_precision(job.compute, "cpu", dims.uses_fsdp)
    rt = Runtime(torch.device("cpu"), autocast, rank=dist.get_rank(), dims=dims,
                 param_dtype=param_dtype)
    torch.manual_seed(0)
    model = build_train_model(job, rt.device, dims)
    optimizers = Optimizers(model.parts, cfg.optim, cfg.train.max_steps)
    ids = torch.randint(0, ARGS.vocab_size, (MICRO_BATCH, SEQ),
                        generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.clone()}
    train_step(cfg, rt, model, optimizers, [batch], 1)
    tracker = TensorMemoryTracker()
    params = [p for part in model.parts for p in part.parameters()]
    tracker.track(params + [ids, batch["labels"]])
    tracker.track(t for opt in optimizers.optimizers for state in opt.state.values()
                  for t in state.values())
    with tracker:
        train_step(cfg, rt, model, optimizers, [batch], 2)
    del model, optimizers
    gc.collect()
    return tracker.peak


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    peaks = {name: measure(fields) for name, fields in LAYOUTS.items()}
    (out / f"peaks-{dist.get_rank()}.json").write_text(json.dumps(peaks))
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
