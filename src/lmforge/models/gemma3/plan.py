"""Gemma 3's tensor-parallel plan (Megatron's layout, ``models/tp.py``); its four block
norms run sequence-parallel, and its q/k norms are replicated over heads as Qwen3's are
(``models/llama/plan.py`` says why). The post-attention and post-MLP norms hand back
plain tensors: their output meets the residual stream, not a projection's input."""
from __future__ import annotations

from torch.distributed.tensor.parallel import SequenceParallel

from lmforge.models.gemma3.model import PROJECTIONS, Gemma3Block
from lmforge.models.tp import megatron_block_plan, model_plan

__all__ = ["block_plan", "model_plan"]


def block_plan(sequence_parallel: bool) -> dict:
    plan = megatron_block_plan(PROJECTIONS, Gemma3Block.NORMS, sequence_parallel)
    if sequence_parallel:  # a post-norm's output is added to the plain residual stream
        for norm in ("post_attention_norm", "post_ffn_norm"):
            plan[norm] = SequenceParallel(use_local_output=True)
    for norm in ("attention.q_norm", "attention.k_norm"):
        plan[norm] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan
