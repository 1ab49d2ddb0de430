"""Llama's tensor-parallel plan (Megatron's layout, ``models/tp.py``): module name ->
DTensor style, as ``parallel/tensor.py`` applies it and tests read it. Both norms run
sequence-parallel."""
from __future__ import annotations

from lmforge.models.llama.model import PROJECTIONS
from lmforge.models.tp import megatron_block_plan, model_plan

__all__ = ["block_plan", "model_plan"]


def block_plan(sequence_parallel: bool) -> dict:
    return megatron_block_plan(PROJECTIONS, ("attention_norm", "ffn_norm"), sequence_parallel)
