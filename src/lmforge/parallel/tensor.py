"""Tensor + sequence parallelism for Llama, with DTensor.

Megatron's layout: q/k/v and gate/up projections split by output columns, o/down
projections by input rows, so each block needs one all-reduce forward and one backward.
With sequence parallelism the norms and residual stream are split along the sequence
instead of replicated, turning each all-reduce into a reduce-scatter + all-gather pair
and dividing the activation memory of the norms and residuals by tp.

The output head stays vocab-sharded and the loss is computed under ``loss_parallel`` so
the full (batch, seq, vocab) logits are never gathered; a vocab size that tp does not
divide is sharded unevenly.
"""
from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


def block_plan(sequence_parallel: bool) -> dict:
    """Module name (inside a TransformerBlock) -> parallel style."""
    residual = Shard(1) if sequence_parallel else Replicate()
    plan = {
        # Attention(x, positions, mask, cache): x gathered to the full sequence first.
        "attention": PrepareModuleInput(
            input_layouts=(residual, None, None, None),
            desired_input_layouts=(Replicate(), None, None, None)),
        "attention.q_proj": ColwiseParallel(),
        "attention.k_proj": ColwiseParallel(),
        "attention.v_proj": ColwiseParallel(),
        "attention.o_proj": RowwiseParallel(output_layouts=residual),
        "feed_forward": PrepareModuleInput(input_layouts=(residual,),
                                           desired_input_layouts=(Replicate(),)),
        "feed_forward.gate_proj": ColwiseParallel(),
        "feed_forward.up_proj": ColwiseParallel(),
        "feed_forward.down_proj": RowwiseParallel(output_layouts=residual),
    }
    if sequence_parallel:
        plan["attention_norm"] = SequenceParallel()
        plan["ffn_norm"] = SequenceParallel()
    return plan


def model_plan(sequence_parallel: bool) -> dict:
    """Top-level modules -> parallel style."""
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


def apply_tensor_parallel(model: nn.Module, tp_mesh, sequence_parallel: bool) -> None:
    """Shards ``model`` (a whole Llama or a pipeline stage) in place over ``tp_mesh``."""
    tied = (getattr(model, "tok_embeddings", None) is not None
            and getattr(model, "output", None) is not None
            and model.output.weight is model.tok_embeddings.weight)
    top = {name: style for name, style in model_plan(sequence_parallel).items()
           if getattr(model, name, None) is not None}
    parallelize_module(model, tp_mesh, top)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan(sequence_parallel))
    if tied:
        # Both styles shard the (vocab, dim) weight by rows, so one DTensor serves both.
        model.output.weight = model.tok_embeddings.weight
