"""Process-group start-up and the device mesh.

Rank and world size come from torchrun (RANK, WORLD_SIZE, LOCAL_RANK) or from SLURM
(SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID) alike. CPU runs use gloo, GPU runs NCCL.
The mesh has four named dimensions, outermost first: pp, dp_replicate, dp_shard, tp, so
tensor parallelism (the chattiest) stays within a node.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from lmforge.config import ConfigError, ParallelConfig

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    torchrun: bool = False  # started by torchrun (its variables), not by SLURM or by hand


def read_dist_env(environ=os.environ) -> DistEnv:
    """torchrun's variables first, SLURM's otherwise, a single process without either."""
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return DistEnv(int(environ["RANK"]), int(environ["WORLD_SIZE"]),
                       int(environ.get("LOCAL_RANK", 0)), torchrun=True)
    if "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ:
        return DistEnv(int(environ["SLURM_PROCID"]), int(environ["SLURM_NTASKS"]),
                       int(environ.get("SLURM_LOCALID", 0)))
    return DistEnv(0, 1, 0)


def init_distributed(env: DistEnv, device_type: str, distributed: bool) -> None:
    """Starts the default process group when the run is ``distributed`` (see
    ``config.runs_distributed``: several processes, or FSDP2 on one)."""
    if not distributed or dist.is_initialized():
        return
    if "MASTER_ADDR" not in os.environ:
        # srun without torchrun: the first node of the allocation hosts the rendezvous.
        os.environ["MASTER_ADDR"] = _slurm_first_host()
        os.environ.setdefault("MASTER_PORT", "29500")
    os.environ.setdefault("RANK", str(env.rank))
    os.environ.setdefault("WORLD_SIZE", str(env.world_size))
    if device_type == "cuda":
        torch.cuda.set_device(env.local_rank)
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo")


def _slurm_first_host() -> str:
    nodes = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not nodes:
        raise ConfigError("parallel: SLURM_PROCID is set but no MASTER_ADDR or "
                          "SLURM_JOB_NODELIST to find the rendezvous host")
    return expand_first_slurm_host(nodes)


def expand_first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list: 'gpu[003-005,007],cpu1' -> 'gpu003'."""
    first = nodelist.split(",")[0] if "[" not in nodelist.split(",")[0] else nodelist
    if "[" not in first:
        return first
    prefix, rest = first.split("[", 1)
    first_range = rest.split("]", 1)[0].split(",")[0]
    return prefix + first_range.split("-")[0]


def mesh_shape(cfg: ParallelConfig, world_size: int) -> dict[str, int]:
    rest = world_size // (cfg.dp_replicate * cfg.tp * cfg.pp)
    dp_shard = rest if cfg.dp_shard == -1 else cfg.dp_shard
    return {"pp": cfg.pp, "dp_replicate": cfg.dp_replicate, "dp_shard": dp_shard, "tp": cfg.tp}


def build_mesh(cfg: ParallelConfig, world_size: int, device_type: str):
    """The 4-D DeviceMesh, with a flattened "dp" dimension for data-parallel collectives."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = mesh_shape(cfg, world_size)
    mesh = init_device_mesh(device_type, tuple(shape.values()), mesh_dim_names=MESH_DIMS)
    mesh["dp_replicate", "dp_shard"]._flatten("dp")
    return mesh


@dataclass
class ParallelDims:
    """Sizes and this rank's coordinates, for code that only needs numbers."""
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp_rank: int = 0
    dp_rank: int = 0
    tp_rank: int = 0

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard


def uses_fsdp(mesh) -> bool:
    """FSDP2 wraps the model when data parallelism is > 1, and on a one-device mesh (one
    process under torchrun with parallel.dp_shard=1: the distributed path on one GPU)."""
    return mesh is not None and (parallel_dims(mesh).dp > 1 or mesh.size() == 1)


def parallel_dims(mesh) -> ParallelDims:
    if mesh is None:
        return ParallelDims()
    size = {name: mesh[name].size() for name in MESH_DIMS}
    return ParallelDims(**size, pp_rank=mesh["pp"].get_local_rank(),
                        dp_rank=mesh["dp"].get_local_rank(),
                        tp_rank=mesh["tp"].get_local_rank())


def group(mesh, name: str) -> Optional[dist.ProcessGroup]:
    return None if mesh is None else mesh[name].get_group()
