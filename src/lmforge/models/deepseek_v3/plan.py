"""DeepSeek-V3's tensor-parallel plan: the top level only, with the residual stream
replicated (no sequence parallelism), so every block runs whole on each tp rank.

Not yet split: MLA's latent projections (q_a_proj, kv_a_proj_with_mqa) and their norms
must be replicated *as DTensors* so that their gradients, which each rank computes only
for its own heads, are summed over the ranks (torchtitan's ``NoParallel``); torch's
public styles have no such entry, and ``models/tp.py``'s Megatron layout would split
them by columns. Then q_b_proj / q_proj and kv_b_proj go column-wise and o_proj
row-wise. The experts are not split by tensor parallelism either."""
from __future__ import annotations

from lmforge.models import tp

__all__ = ["block_plan", "model_plan"]


def block_plan(sequence_parallel: bool) -> dict:
    return {}


def model_plan(sequence_parallel: bool) -> dict:
    # The blocks take the whole sequence: a sequence-sharded residual would reach the
    # unsplit attention as a slice of it.
    return tp.model_plan(False)
