"""Tensor + sequence parallelism with DTensor, applied from the family's plan
(``models/<family>/plan.py``: which projections split by columns, which by rows, which
modules run sequence-parallel).

With sequence parallelism the norms and residual stream are split along the sequence
instead of replicated, dividing the activation memory of the norms and residuals by tp.

The output head stays vocab-sharded and the loss is computed under ``loss_parallel`` so
the full (batch, seq, vocab) logits are never gathered; a vocab size that tp does not
divide is sharded unevenly.
"""
from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import parallelize_module

from lmforge.models.gated_deltanet import GatedDeltaNet
from lmforge.models.moe import MoE
from lmforge.models.registry import family_of
from lmforge.models.tp import ReplicatedMoE, linear_attention_plan


def apply_tensor_parallel(model: nn.Module, tp_mesh, sequence_parallel: bool) -> None:
    """Shards ``model`` (a whole model or a pipeline stage) in place over ``tp_mesh``."""
    family = family_of(model.args)
    tied = (getattr(model, "tok_embeddings", None) is not None
            and getattr(model, "output", None) is not None
            and model.output.weight is model.tok_embeddings.weight)
    parallelize_module(model, tp_mesh, _present(model, family.model_plan(sequence_parallel)))
    for block in model.layers.values():
        plan = family.block_plan(sequence_parallel)
        if isinstance(getattr(block, "attention", None), GatedDeltaNet):  # split by heads too
            plan = {name: style for name, style in plan.items()
                    if name.split(".")[0] != "attention"}
            plan |= linear_attention_plan(sequence_parallel)
        if isinstance(getattr(block, "feed_forward", None), MoE):  # whole on every rank
            plan = {name: style for name, style in plan.items()
                    if name.split(".")[0] != "feed_forward"}
            plan["feed_forward"] = ReplicatedMoE()
        parallelize_module(block, tp_mesh, _present(block, plan))
    if tied:
        # Both styles shard the (vocab, dim) weight by rows, so one DTensor serves both.
        model.output.weight = model.tok_embeddings.weight
    # (the decoder pads a forward's tokens to a multiple of this: models/generate.py)
    model.sequence_shards = tp_mesh.size() if sequence_parallel else 1


def _present(module: nn.Module, plan: dict) -> dict:
    """The entries of ``plan`` naming a submodule ``module`` has: a pipeline stage lacks
    the embedding, norm or head of the others (set to None), a family's plan may name
    modules only some of its models have (Qwen3's q/k norms)."""
    present = {}
    for name, style in plan.items():
        try:
            module.get_submodule(name)  # raises for a missing or None submodule
        except AttributeError:
            continue
        present[name] = style
    return present
