"""Apply parallelism and training wraps to a plain Llama (or a pipeline stage of one), in
a fixed order: expert parallel -> tensor + sequence parallel -> activation checkpointing
-> per-block compile -> FSDP2 (which leaves the expert-parallel weights to their own
mesh). Parameter names never change, so checkpoints do not depend on it."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lmforge.config import JobConfig
from lmforge.models.moe import MoE
from lmforge.parallel.expert import (expert_parallel_modules, expert_parallel_params,
                                     shard_experts)
from lmforge.parallel.fsdp import apply_fsdp, apply_fsdp_to_experts
from lmforge.parallel.mesh import ParallelDims
from lmforge.parallel.tensor import apply_tensor_parallel


def apply_model_parallel(model: nn.Module, dims: ParallelDims, cfg: JobConfig) -> None:
    """Expert parallel, tensor + sequence parallel, then activation checkpointing and
    compile per block."""
    if cfg.parallel.ep > 1:
        apply_expert_parallel(model, dims)
    if dims.tp > 1:
        apply_tensor_parallel(model, dims.submesh("tp"), cfg.parallel.sequence_parallel)
    for layer in model.layers.values():
        if _checkpointed(cfg, int(layer.layer_id)):
            checkpoint_forward(layer)
        if cfg.train.compile:
            layer.compile()


def apply_data_parallel(model: nn.Module, dims: ParallelDims, cfg: JobConfig,
                        param_dtype: Optional[torch.dtype] = None) -> None:
    """FSDP2 over the data-parallel dimensions (HSDP when both are > 1); the
    expert-parallel weights over the data-parallel ranks that hold the same experts."""
    if dims.uses_fsdp:
        # the cp ranks hold the same weights and add their parts of each gradient: FSDP
        # shards over them too (as torchtitan does)
        shard = "dp_shard_cp" if dims.cp > 1 else "dp_shard"
        dp_mesh = (dims.submesh(shard) if dims.dp_replicate == 1
                   else dims.submesh("dp_replicate", shard))
        experts = expert_parallel_modules(model)
        if experts and dims.expert_dp > 1:
            expert_mesh = (dims.submesh("efsdp") if dims.dp_replicate == 1
                           else dims.submesh("dp_replicate", "efsdp"))
            apply_fsdp_to_experts(experts, expert_mesh, cfg.parallel.zero, param_dtype)
            ignored = None  # (each experts module is its own unit, already)
        else:  # every dp rank holds other experts: nothing to shard or reduce over
            for module in experts:  # (FSDP's param_dtype does not reach them)
                module.param_dtype = param_dtype
            ignored = expert_parallel_params(model)
        apply_fsdp(model, dp_mesh, cfg.parallel.zero, param_dtype, ignored_params=ignored)


def apply_expert_parallel(model: nn.Module, dims: ParallelDims) -> None:
    """Every MoE layer's routed experts split over the mesh's ep ranks (``parallel.ep``,
    inside dp_shard: ``parallel.mesh``).

    Each rank's expert gradient already holds its ep group's tokens routed to its
    experts (the all-to-all's backward brings them), and each rank's loss is multiplied
    by dp (``train.step.normalize_loss``) for FSDP's average to be a sum; FSDP averages
    the experts' gradients over the dp / ep ranks holding the same experts
    (``apply_data_parallel``), so here they are divided by the remaining ep
    (``ExpertParallelMixin.grad_scale``)."""
    ep_mesh = dims.submesh("ep")
    for layer in model.layers.values():
        moe = getattr(layer, "feed_forward", None)
        if isinstance(moe, MoE):
            shard_experts(moe, ep_mesh)
            moe.experts.grad_scale = 1.0 / dims.ep


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
