"""gpt-oss's tensor-parallel plan: Llama's for the attention and the norms. The experts
are not split by tensor parallelism (``models.presets.check_layout_fits`` refuses tp for
an MoE model until they are), and neither are the sinks: a sharded attention would need
each rank's heads' share of them (Shard(0))."""
from __future__ import annotations

from lmforge.models.llama.plan import block_plan as llama_block_plan
from lmforge.models.llama.plan import model_plan

__all__ = ["block_plan", "model_plan"]


def block_plan(sequence_parallel: bool) -> dict:
    """Llama's entries less its MLP's linears and its q/k norms, which gpt-oss lacks."""
    plan = llama_block_plan(sequence_parallel)
    return {name: style for name, style in plan.items()
            if not name.startswith(("feed_forward.", "attention.q_norm", "attention.k_norm"))}
