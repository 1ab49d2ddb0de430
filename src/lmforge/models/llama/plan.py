"""Llama's tensor-parallel plan (Megatron's layout, ``models/tp.py``): module name ->
DTensor style, as ``parallel/tensor.py`` applies it and tests read it. Both norms run
sequence-parallel. Entries for modules a model lacks (the q/k norms outside Qwen3) are
skipped by ``parallel/tensor.py``."""
from __future__ import annotations

from torch.distributed.tensor.parallel import SequenceParallel

from lmforge.models.llama.model import PROJECTIONS
from lmforge.models.tp import megatron_block_plan, model_plan

__all__ = ["block_plan", "model_plan"]


def block_plan(sequence_parallel: bool) -> dict:
    plan = megatron_block_plan(PROJECTIONS, ("attention_norm", "ffn_norm"), sequence_parallel)
    # Qwen3's q/k norms: one weight over head_dim for every head, and each rank holds only
    # its heads. The weight is replicated as a DTensor over an input sharded by heads (dim
    # 2 of (batch, seq, heads, head_dim)), so its gradient is summed over the tp ranks; a
    # plain weight would get only this rank's heads' share and the copies would drift.
    for norm in ("attention.q_norm", "attention.k_norm"):
        plan[norm] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan
