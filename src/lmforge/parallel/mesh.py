"""Process-group start-up and the device mesh.

Rank and world size come from torchrun (RANK, WORLD_SIZE, LOCAL_RANK) or from SLURM
(SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID) alike. CPU runs use gloo, GPU runs NCCL.
The mesh has five named dimensions, outermost first: pp, dp_replicate, dp_shard, cp, tp,
so tensor parallelism (the chattiest) stays within a node. With expert parallelism,
dp_shard is two, efsdp and ep (ep innermost, so an expert group's all-to-all stays
within as few nodes as it can), flattened back into dp_shard for everything else.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from lmforge.config import ConfigError, ParallelConfig, resolve_layout

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


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


def runs_distributed(parallel: ParallelConfig, world_size: int, torchrun: bool) -> bool:
    """Whether a run uses a process group and a device mesh: with several processes, and
    with one started by torchrun with ``parallel.dp_shard=1`` (FSDP2 on one device, so the
    distributed path can be checked on one GPU). Otherwise one plain process."""
    return world_size > 1 or (torchrun and parallel.dp_shard == 1)


def init_distributed(env: DistEnv, device_type: str, distributed: bool,
                     timeout_s: int = 600) -> None:
    """Starts the default process group when the run is ``distributed`` (see
    ``runs_distributed``: several processes, or FSDP2 on one). ``timeout_s``
    (``parallel.timeout_s``): how long a collective waits for a rank that does not come."""
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
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if device_type == "cuda" else "gloo"
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        dist.init_process_group(backend, timeout=timeout)
        return
    # Under torchrun, each attempt's keys under a prefix of their own: after a restart
    # the store can still hold the last attempt's, and a rank that reads a dead rank's
    # address before its successor writes a new one fails to connect (seen with gloo).
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    dist.init_process_group(backend, store=dist.PrefixStore(f"lmforge/attempt-{attempt}",
                                                            store),
                            rank=rank, world_size=world_size, timeout=timeout)


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


def build_parallel_dims(cfg: ParallelConfig, world_size: int, device_type: str
                        ) -> "ParallelDims":
    """The DeviceMesh (with a flattened "dp" dimension for data-parallel collectives)
    of the layout ``config.resolve_layout`` resolves, and this rank's place in it."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = resolve_layout(cfg, world_size)
    sizes = dict(shape)
    shard_dims = ("dp_shard",)
    if cfg.ep > 1:
        # Expert parallelism's ranks come out of dp_shard (as torchtitan's): its inner
        # ep consecutive ranks split the experts, the outer dp_shard / ep ("efsdp")
        # shard each expert's weights with FSDP; dp_shard is their flattening, as before.
        shard_dims = ("efsdp", "ep")
        del sizes["dp_shard"]
        sizes |= {"efsdp": shape["dp_shard"] // cfg.ep, "ep": cfg.ep}
    names = tuple(n for d in MESH_DIMS for n in (shard_dims if d == "dp_shard" else (d,)))
    mesh = init_device_mesh(device_type, tuple(sizes[n] for n in names),
                            mesh_dim_names=names)
    if cfg.ep > 1:
        mesh[shard_dims]._flatten("dp_shard")
    mesh[("dp_replicate", *shard_dims)]._flatten("dp")  # the data: each its own batches
    if shape["cp"] > 1:
        mesh[(*shard_dims, "cp")]._flatten("dp_shard_cp")  # FSDP's shards (cp ranks too)
        mesh[("dp_replicate", *shard_dims, "cp")]._flatten("dp_cp")  # a step's sums
    dims = ParallelDims(**shape, ep=cfg.ep, mesh=mesh)
    return dataclasses.replace(dims, **{f"{d}_rank": dims.submesh(d).get_local_rank()
                                        for d in ("pp", "dp", "cp", "tp")})


@dataclass(frozen=True)
class ParallelDims:
    """The resolved layout, built once per run and passed down: each mesh dimension's
    size, this rank's coordinates, and the DeviceMesh (None: one plain process)."""
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1  # expert parallelism, within dp_shard (the mesh's "ep" and "efsdp")
    pp_rank: int = 0
    dp_rank: int = 0
    cp_rank: int = 0
    tp_rank: int = 0
    mesh: Any = None

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def expert_dp(self) -> int:
        """The data-parallel ranks holding the same experts (dp / ep), over which FSDP
        shards and reduces the expert-parallel weights."""
        return self.dp // self.ep

    @property
    def uses_fsdp(self) -> bool:
        """FSDP2 wraps the model when data parallelism is > 1, and on a one-device mesh
        (one process under torchrun with parallel.dp_shard=1: the distributed path on one
        GPU)."""
        return self.mesh is not None and (self.dp * self.cp > 1
                                          or self.pp * self.dp * self.tp == 1)

    @property
    def dp_cp_group(self) -> str:
        """The mesh dimension over which a step's losses and token counts add up: the
        data-parallel ranks, with their cp ranks (each holds part of every sequence)."""
        return "dp_cp" if self.cp > 1 else "dp"

    def group(self, name: str) -> Optional[dist.ProcessGroup]:
        """The process group of mesh dimension ``name`` (None in one plain process)."""
        return None if self.mesh is None else self.submesh(name).get_group()

    def submesh(self, *names: str):
        """The mesh of dimensions ``names`` (a flattened one, such as dp or dp_shard under
        ep, alone or beside dp_replicate for HSDP). torch (2.11 on) warns on every slice
        of a flattened dimension that this will go; it still works, and one run slices
        dozens of times, so the warning is kept out of the run's log here."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Slicing a flattened dim")
            return self.mesh[names if len(names) > 1 else names[0]]
