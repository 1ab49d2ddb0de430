"""Training steps with and without ``train.activation_offload`` in the 2-process layouts,
through the trainer's own step (``loop.train_step``, as ``family_training``), on GPT-J's
tiny shape.

``torchrun --nproc-per-node=2 offload_training.py OUT`` trains each layout of ``RUNS``
twice from the same weights and data, without and with offloading, and compares on every
rank the per-step loss and grad norm and this rank's gradients (its shards, as the update
reads them) bit for bit. Rank 0 writes OUT/results.json: run -> {"equal": on all ranks,
"stats": rank 0's OffloadStats} or {"error": traceback}. The offload threshold is lowered
so the tiny block inputs (a few KiB) are offloaded.
"""
from __future__ import annotations

import dataclasses
import gc
import json
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from helpers import family_training as ft
from lmforge.parallel.mesh import build_parallel_dims, init_distributed, read_dist_env
from lmforge.parallel import offload
from lmforge.train.loop import train_step
from lmforge.job import resolve
from lmforge.train.model_setup import build_train_model
from lmforge.train.optim import Optimizers

ARGS = ft.FAMILIES["gptj"]
RUNS = {  # name -> config fields
    "fsdp_dp2": {"parallel.dp_shard": 2},
    "fsdp_dp2_ac_full": {"parallel.dp_shard": 2, "train.activation_checkpointing": "full"},
    # block inputs are plain (sequence-sharded) tensors; the DTensors inside stay
    "tp2_sp_ac_full": {"parallel.tp": 2, "train.activation_checkpointing": "full"},
    "pp2_ac_full": {"parallel.pp": 2, "train.activation_checkpointing": "full"},
}


def train(fields: dict, world_size: int) -> tuple[list, list, object]:
    """Per-step (loss, grad norm) and gradients (this rank's local tensors, clipped, as
    the optimizer is about to read them) of ``ft.STEPS`` steps."""
    cfg = ft.job_config(fields, world_size)
    dims = build_parallel_dims(cfg.parallel, world_size, "cpu")
    rt = ft.runtime(dims)
    torch.manual_seed(cfg.train.seed)
    model = build_train_model(resolve(cfg, world_size, args=ARGS), rt.device, dims)
    optimizers = Optimizers(model.parts, cfg.optim, cfg.train.max_steps)
    losses, grads = [], []
    for optimizer in optimizers.optimizers:
        optimizer.register_step_pre_hook(lambda *_: grads.append(
            [_local(p.grad).clone() for p in model.parameters()]))
    for step, sample in enumerate(ft.step_samples(ARGS.vocab_size), 1):
        result = train_step(cfg, rt, model, optimizers,
                            ft.rank_micro_batches(sample, cfg, dims), step)
        losses.append(torch.stack([result.loss, result.grad_norm]))
    assert len(grads) == ft.STEPS, "the hook saw no update"  # (an empty list compares equal)
    return losses, grads, model.offload


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def compare(fields: dict, world_size: int) -> dict:
    plain_losses, plain_grads, _ = train(fields, world_size)
    losses, grads, offloader = train({**fields, "train.activation_offload": True}, world_size)
    equal = (all(torch.equal(a, b) for a, b in zip(plain_losses, losses))
             and all(torch.equal(a, b) for step_a, step_b in zip(plain_grads, grads)
                     for a, b in zip(step_a, step_b)))
    everywhere = torch.tensor(int(equal))
    dist.all_reduce(everywhere, op=dist.ReduceOp.MIN)
    return {"equal": bool(everywhere), "stats": dataclasses.asdict(offloader.stats)}


def main(out: Path) -> None:
    env = read_dist_env()
    torch.set_num_threads(1)
    init_distributed(env, "cpu", distributed=True)
    offload.MIN_OFFLOAD_BYTES = 1024
    results = {}
    for name, fields in RUNS.items():
        try:
            results[name] = compare(fields, env.world_size)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    if env.rank == 0:
        (out / "results.json").write_text(json.dumps(results, indent=1))
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
