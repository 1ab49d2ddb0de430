"""Fully-sharded data parallelism with FSDP2 (``fully_shard``).

Each transformer block is its own FSDP unit, so its parameters are all-gathered just
before use and its gradients reduce-scattered as soon as its backward ends: the
communication of one block overlaps the computation of the next (FSDP2 prefetches the
next block's all-gather in both directions). ZeRO-3 frees the gathered parameters after
forward; ZeRO-2 keeps them until backward, trading memory for one all-gather less. With
dp_replicate > 1 the same call gives HSDP: sharded within a group, replicated across.

FSDP averages gradients over the data-parallel ranks. Our loss is already divided by the
global token count, so the trainer multiplies each rank's loss by the data-parallel size
before backward (``train.step.normalize_loss``) to turn that average into the needed sum;
a divide factor of 1 would do the same but needs PREMUL_SUM, which gloo lacks.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn


def apply_fsdp(model: nn.Module, dp_mesh, zero: int, param_dtype: Optional[torch.dtype],
               reduce_dtype: torch.dtype = torch.float32,
               ignored_params: Optional[set] = None) -> None:
    """``ignored_params``: parameters FSDP neither shards nor reduces (expert parallelism's,
    already split over their own mesh)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    reshard = zero == 3
    ignored = ignored_params or None
    for layer in model.layers.values():
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp,
                    ignored_params=ignored)
    # The root unit holds the embedding, final norm and head. Its parameters are needed
    # again first in backward, so keeping them gathered after forward costs nothing extra.
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, mp_policy=mp,
                ignored_params=ignored)
    _prefetch_neighbours(list(model.layers.values()))


def apply_fsdp_to_experts(experts: list[nn.Module], mesh, zero: int,
                          param_dtype: Optional[torch.dtype],
                          reduce_dtype: torch.dtype = torch.float32) -> None:
    """Each expert-parallel experts module its own FSDP unit over ``mesh``, the
    data-parallel ranks holding the same experts (its weights already split by expert
    over ep): sharded by their second dim, as torchtitan does, so that fewer local
    experts than ranks still split evenly and the placements stay (Shard(1), Shard(0))
    rather than two shards of one dim. Call before ``apply_fsdp``, whose block units
    then leave these parameters to them."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for module in experts:
        fully_shard(module, mesh=mesh, reshard_after_forward=zero == 3, mp_policy=mp,
                    shard_placement_fn=lambda param: Shard(1))


def _prefetch_neighbours(layers: list[nn.Module]) -> None:
    """Issue the all-gather of the next block (previous one in backward) while the
    current one computes, explicitly rather than relying on FSDP's implicit ordering."""
    if not layers or not hasattr(layers[0], "set_modules_to_forward_prefetch"):
        return
    for i, layer in enumerate(layers):
        if i + 1 < len(layers):
            layer.set_modules_to_forward_prefetch([layers[i + 1]])
        if i > 0:
            layer.set_modules_to_backward_prefetch([layers[i - 1]])
