"""GPT-J's tensor-parallel plan (Megatron's layout, ``models/tp.py``): fc_in split by
columns with its bias, fc_out by rows with its bias added once after the reduction; the
one LayerNorm runs sequence-parallel and both branches gather its output."""
from __future__ import annotations

from lmforge.models.gptj.model import PROJECTIONS
from lmforge.models.tp import megatron_block_plan, model_plan

__all__ = ["block_plan", "model_plan"]


def block_plan(sequence_parallel: bool) -> dict:
    return megatron_block_plan(PROJECTIONS, ("attention_norm",), sequence_parallel)
