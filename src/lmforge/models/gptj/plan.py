"""GPT-J's tensor-parallel plan. Megatron's layout as for Llama (q/k/v and fc_in split by
output columns with fc_in's bias, out_proj and fc_out by input rows with fc_out's bias
added once after the reduction); the one LayerNorm runs sequence-parallel and both
branches gather its output. The top level (embedding, final norm, vocab-sharded head with
its bias) is Llama's."""
from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from lmforge.models.llama.plan import model_plan  # the same top level as Llama's

__all__ = ["block_plan", "model_plan"]


def block_plan(sequence_parallel: bool) -> dict:
    """Module name (inside a GPT-J block) -> parallel style."""
    residual = Shard(1) if sequence_parallel else Replicate()
    plan = {
        "attention": PrepareModuleInput(
            input_layouts=(residual, None, None, None),
            desired_input_layouts=(Replicate(), None, None, None)),
        "attention.q_proj": ColwiseParallel(),
        "attention.k_proj": ColwiseParallel(),
        "attention.v_proj": ColwiseParallel(),
        "attention.out_proj": RowwiseParallel(output_layouts=residual),
        "feed_forward": PrepareModuleInput(input_layouts=(residual,),
                                           desired_input_layouts=(Replicate(),)),
        "feed_forward.fc_in": ColwiseParallel(),
        "feed_forward.fc_out": RowwiseParallel(output_layouts=residual),
    }
    if sequence_parallel:
        plan["attention_norm"] = SequenceParallel()
    return plan
