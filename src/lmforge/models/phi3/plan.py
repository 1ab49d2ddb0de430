"""Phi-3's tensor-parallel plan (Megatron's layout, ``models/tp.py``): the fused qkv and
gate_up projections split by output rows, which their grouped layout
(``models.family.Fused``) makes a split by kv heads and by hidden units; o and down by
input rows. Both norms run sequence-parallel."""
from __future__ import annotations

from lmforge.models.phi3.model import PROJECTIONS
from lmforge.models.tp import megatron_block_plan, model_plan

__all__ = ["block_plan", "model_plan"]


def block_plan(sequence_parallel: bool) -> dict:
    return megatron_block_plan(PROJECTIONS, ("attention_norm", "ffn_norm"), sequence_parallel)
