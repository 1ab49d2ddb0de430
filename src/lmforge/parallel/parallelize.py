"""Apply parallelism and training wraps to a plain Llama (or a pipeline stage of one), in
a fixed order: tensor + sequence parallel -> activation checkpointing -> per-block
compile -> FSDP2. Parameter names never change, so checkpoints do not depend on it."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lmforge.config import JobConfig
from lmforge.parallel.fsdp import apply_fsdp
from lmforge.parallel.mesh import ParallelDims
from lmforge.parallel.tensor import apply_tensor_parallel


def apply_model_parallel(model: nn.Module, dims: ParallelDims, cfg: JobConfig) -> None:
    """Tensor + sequence parallel, then activation checkpointing and compile per block."""
    if dims.tp > 1:
        apply_tensor_parallel(model, dims.mesh["tp"], cfg.parallel.sequence_parallel)
    for layer in model.layers.values():
        if _checkpointed(cfg, int(layer.layer_id)):
            checkpoint_forward(layer)
        if cfg.train.compile:
            layer.compile()


def apply_data_parallel(model: nn.Module, dims: ParallelDims, cfg: JobConfig,
                        param_dtype: Optional[torch.dtype] = None) -> None:
    """FSDP2 over the data-parallel dimensions (HSDP when both are > 1)."""
    if dims.uses_fsdp:
        mesh = dims.mesh
        # the cp ranks hold the same weights and add their parts of each gradient: FSDP
        # shards over them too (as torchtitan does)
        shard = "dp_shard_cp" if dims.cp > 1 else "dp_shard"
        dp_mesh = mesh[shard] if dims.dp_replicate == 1 else mesh["dp_replicate", shard]
        apply_fsdp(model, dp_mesh, cfg.parallel.zero, param_dtype)


def _checkpointed(cfg: JobConfig, layer_id: int) -> bool:
    return checkpointed_block(cfg.train.activation_checkpointing,
                              cfg.train.activation_checkpointing_every, layer_id)


def checkpointed_block(mode: str, every: int, layer_id: int) -> bool:
    """Whether block ``layer_id`` (the model's numbering) recomputes in backward under
    train.activation_checkpointing ``mode``: every block under full; under selective
    blocks 0, every, 2 every, ..., trading part of the memory saving for speed. The
    memory estimate asks the same (perf/estimate_setup.py)."""
    return mode == "full" or (mode == "selective" and layer_id % every == 0)


def checkpoint_forward(module: nn.Module) -> None:
    """Recompute ``module``'s activations in backward instead of storing them.

    Replacing the instance's forward (rather than wrapping the module in another) keeps
    the parameter names, so checkpoints do not depend on this setting."""
    inner = module.forward

    def forward(*args, **kwargs):
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    module.forward = forward
