"""gpt-oss's tensor-parallel plan: Llama's for the attention and the norms, with the
per-head sinks split as the heads are. The experts run whole on every rank
(``parallel/tensor.py``: ``models.tp.ReplicatedMoE``)."""
from __future__ import annotations

from lmforge.models.llama.plan import block_plan as llama_block_plan
from lmforge.models.llama.plan import model_plan
from lmforge.models.tp import ShardedParameters

__all__ = ["block_plan", "model_plan"]


def block_plan(sequence_parallel: bool) -> dict:
    """Llama's entries less its MLP's linears and its q/k norms, which gpt-oss lacks."""
    plan = llama_block_plan(sequence_parallel)
    plan = {name: style for name, style in plan.items()
            if not name.startswith(("feed_forward.", "attention.q_norm", "attention.k_norm"))}
    # each rank's heads' sinks beside them (the attention's input style first)
    plan["attention"] = ShardedParameters("sinks", then=plan["attention"])
    return plan
