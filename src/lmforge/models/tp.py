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

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
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
