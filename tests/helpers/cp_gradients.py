"""``torchrun --nproc-per-node=2 cp_gradients.py OUT``: each family's gradients after one
forward/backward of a step over packed documents, in one plain process (rank 0) and under
parallel.cp=2, through the trainer's own ``TrainModel.forward_backward``; rank 0 writes
OUT/cp-gradients.json: family -> the largest per-parameter relative difference."""
from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend, sdpa_kernel

from helpers import family_training as ft
from lmforge.job import resolve
from lmforge.parallel.mesh import (ParallelDims, build_parallel_dims, init_distributed,
                                   read_dist_env)
from lmforge.train.model_setup import build_train_model


def gradients(args, fields: dict, world_size: int) -> dict:
    cfg = ft.job_config(fields, world_size)
    dims = (build_parallel_dims(cfg.parallel, world_size, "cpu") if world_size > 1
            else ParallelDims())
    job = resolve(cfg, world_size, distributed=world_size > 1, args=args)
    torch.manual_seed(cfg.train.seed)
    model = build_train_model(job, torch.device("cpu"), dims)
    batches = ft.rank_micro_batches(ft.step_samples(args.vocab_size, True)[0], cfg, dims)
    n_valid = sum(int((b["labels"] != -100).sum()) for b in batches)
    with sdpa_kernel(SDPBackend.MATH):
        model.forward_backward(batches, n_valid, torch.device("cpu"), contextlib.nullcontext)
    out = {}
    for name, p in model.parts[0].named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        out[name] = grad.clone()
    return out


def main(out: Path) -> None:
    env = read_dist_env()
    torch.set_num_threads(1)
    init_distributed(env, "cpu", distributed=True)
    result = {}
    for family, args in ft.FAMILIES.items():
        single = gradients(args, {}, 1) if env.rank == 0 else None
        cp = gradients(args, {"parallel.cp": 2}, env.world_size)
        if env.rank == 0:
            result[family] = max(float((cp[k] - g).norm() / g.norm().clamp_min(1e-30))
                                 for k, g in single.items())
    if env.rank == 0:
        (out / "cp-gradients.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
