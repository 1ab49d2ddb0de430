"""Qwen3-Next: Qwen3.5's hybrid layers (Gated DeltaNet, gated attention) with a mixture of
experts and a gated shared expert as the feed-forward; checkpoints fuse the linear layers'
input projections."""
import dataclasses

from lmforge.models.family import from_folder
from lmforge.models.qwen3_next import gguf, hf, model, plan, presets  # the family's parts
from lmforge.models.qwen3_next.model import HybridSparse, HybridSparseArgs, HybridSparseBlock

FAMILY = dataclasses.replace(
    from_folder(model, hf, plan, presets, name="qwen3_next", model_types=("qwen3_next",),
                build=HybridSparse, args_from_dict=HybridSparseArgs.from_dict,
                checkpoint_in=hf.checkpoint_in, checkpoint_out=hf.checkpoint_out,
                gguf=gguf),
    projections=model.FUSED_PROJECTIONS)

__all__ = ["FAMILY", "HybridSparse", "HybridSparseArgs", "HybridSparseBlock"]
