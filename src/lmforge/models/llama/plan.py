"""Llama's tensor-parallel plan (Megatron's layout), as dicts of module name -> DTensor
style that ``parallel/tensor.py`` applies and tests read.

q/k/v and gate/up are split by output columns, o/down by input rows, so each block needs
one all-reduce forward and one backward. With sequence parallelism the norms and the
residual stream are split along the sequence instead of replicated, turning each
all-reduce into a reduce-scatter + all-gather pair. The output head stays vocab-sharded for
the parallel loss. Entries for modules a model lacks (the q/k norms outside Qwen3) are
skipped by ``parallel/tensor.py``.
"""
from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
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
        # Qwen3's q/k norms: one weight over head_dim for every head, and each rank holds
        # only its heads. The weight is replicated as a DTensor over an input sharded by
        # heads (dim 2 of (batch, seq, heads, head_dim)), so its gradient is summed over
        # the tp ranks; a plain weight would get only this rank's heads' share and drift.
        "attention.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "attention.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
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
