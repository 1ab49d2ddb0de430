"""Megatron's tensor-parallel layout for a block, from its projection names (each family's
``plan.py`` names its own), and the top level every family shares.

In a block, q/k/v and the MLP's input projections are split by output columns (with
their biases), the attention and MLP outputs by input rows (a bias added once, after the
reduction), so each branch needs one all-reduce forward and one backward. With sequence
parallelism the norms and the residual stream are split along the sequence instead of
replicated, turning each all-reduce into a reduce-scatter + all-gather pair. The output
head stays vocab-sharded (with its bias) for the parallel loss.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from lmforge.models.common import Projections


def megatron_block_plan(projections: Projections, norms: tuple[str, ...],
                        sequence_parallel: bool) -> dict:
    """Module name (inside a block) -> parallel style."""
    residual = Shard(1) if sequence_parallel else Replicate()
    plan = {
        # attention(x, positions, mask, cache): x gathered to the full sequence first.
        "attention": PrepareModuleInput(
            input_layouts=(residual, None, None, None),
            desired_input_layouts=(Replicate(), None, None, None)),
        **{f"attention.{p}": ColwiseParallel() for p in projections.attention[:-1]},
        f"attention.{projections.attention_output}": RowwiseParallel(output_layouts=residual),
    }
    if projections.mlp:  # (a family of experts in every layer has no dense MLP)
        plan |= {
            "feed_forward": PrepareModuleInput(input_layouts=(residual,),
                                               desired_input_layouts=(Replicate(),)),
            **{f"feed_forward.{p}": ColwiseParallel() for p in projections.mlp_inputs},
            f"feed_forward.{projections.mlp_output}": RowwiseParallel(output_layouts=residual),
        }
    if sequence_parallel:
        plan.update({norm: SequenceParallel() for norm in norms})
    return plan


def linear_attention_plan(sequence_parallel: bool) -> dict:
    """A linear-attention layer's (Gated DeltaNet's, ``models.gated_deltanet``) part of a
    block's plan, in place of the attention's: split by its heads as attention is. Each
    rank takes whole key heads with the value heads they serve: their rows of the input
    projections (in_proj_qkv's grouped per key head for it) by columns, their channels of
    the convolution, their dt_bias and A_log, and out_proj's matching inputs by rows. The
    state is per head, so the recurrence needs no communication; the gated norm's one
    weight serves every head and is summed over the ranks (``HeadShardedNorm``)."""
    # (imported here: gated_deltanet imports Llama's norm, whose family imports this)
    from lmforge.models.gated_deltanet import INPUT_PROJECTIONS, OUTPUT_PROJECTION

    residual = Shard(1) if sequence_parallel else Replicate()
    return {
        "attention": LinearAttentionHeads(then=PrepareModuleInput(
            input_layouts=(residual, None, None, None),
            desired_input_layouts=(Replicate(), None, None, None))),
        **{f"attention.{p}": ColwiseParallel() for p in INPUT_PROJECTIONS},
        "attention.conv1d": ShardedParameters("weight"),
        "attention.norm": HeadShardedNorm(),
        f"attention.{OUTPUT_PROJECTION}": RowwiseParallel(output_layouts=residual),
    }


def model_plan(sequence_parallel: bool) -> dict:
    """Top-level modules -> parallel style (the same in every family)."""
    residual = Shard(1) if sequence_parallel else Replicate()
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual),
        # Logits stay sharded over the vocabulary (a DTensor) for the parallel loss.
        "output": ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1),
                                  use_local_output=False),
    }
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
    return plan


class ReplicatedMoE(ParallelStyle):
    """A mixture of experts computed whole on every tensor-parallel rank: its input
    gathered to the whole sequence (a plain tensor), its weights plain (each rank holds
    every expert and computes the same gradients; FSDP2 may still shard them over the
    data-parallel ranks), its output cut back to this rank's part of the sequence when
    the input came sequence-parallel (a DTensor sharded by sequence, from a
    SequenceParallel norm; a plain input is the whole sequence already: a family whose
    blocks run unsplit). Each rank's router sees the whole sequence, so the routing and
    the load-balancing loss are one process's. (Splitting the experts is expert
    parallelism's, not this style's.)"""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        sharded = []  # (per call: whether the output goes back to sequence shards)

        def gather(_, args):
            x = args[0]
            sharded.append(isinstance(x, DTensor) and x.placements == (Shard(1),))
            if isinstance(x, DTensor):
                x = x.redistribute(placements=(Replicate(),)).to_local()
            return (x, *args[1:])

        def scatter(_, args, output):
            out, routing = output  # (batch, seq, dim), the same on every rank
            if not sharded.pop():
                return output
            whole = DTensor.from_local(out, device_mesh, (Replicate(),), run_check=False)
            return whole.redistribute(placements=(Shard(1),)).to_local(), routing

        module.register_forward_pre_hook(gather)
        module.register_forward_hook(scatter)
        return module


class ShardedParameters(ParallelStyle):
    """A module's own parameters ``names`` split by dim 0 over the tensor-parallel ranks
    (gpt-oss's per-head attention sinks, which follow the heads q_proj's columns split),
    after ``then``, the module's other style (its input's, say)."""

    def __init__(self, *names: str, then: ParallelStyle = None):
        super().__init__()
        self.names, self.then = names, then

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        for name in self.names:
            param = getattr(module, name)
            sharded = distribute_tensor(param.data, device_mesh, (Shard(0),))
            module.register_parameter(name, nn.Parameter(sharded, param.requires_grad))
        return self.then._apply(module, device_mesh) if self.then is not None else module



class HeadShardedNorm(ParallelStyle):
    """A norm over each head's features whose one weight serves every head, called on
    this rank's heads (dim 2 of (batch, seq, heads, features)), with any number of
    tensor inputs (Gated DeltaNet's gated norm takes its gate too, which torch's
    ``SequenceParallel(sequence_dim=2)`` would drop): the weight replicated as a DTensor,
    so its gradient is summed over the ranks (a plain weight would get this rank's heads'
    share and the copies would drift), every input read as split by heads, the output
    this rank's heads as a tensor."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            replicated = distribute_tensor(param.data, device_mesh, (Replicate(),))
            module.register_parameter(name, nn.Parameter(replicated, param.requires_grad))

        def by_heads(_, args):
            return tuple(DTensor.from_local(a, device_mesh, (Shard(2),), run_check=False)
                         if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) else a
                         for a in args)

        def local(_, args, output):
            return output.to_local() if isinstance(output, DTensor) else output

        module.register_forward_pre_hook(by_heads)
        module.register_forward_hook(local)
        return module


class LinearAttentionHeads(ShardedParameters):
    """A Gated DeltaNet's own per-head parameters (dt_bias, A_log) split as its heads,
    and the layer told into how many parts (``head_shards``: its decoding state holds
    this rank's heads; FSDP2 splits parameters too, so their local shapes cannot say)."""

    def __init__(self, then: ParallelStyle):
        super().__init__("dt_bias", "A_log", then=then)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        module.head_shards = device_mesh.size()
        return super()._apply(module, device_mesh)
