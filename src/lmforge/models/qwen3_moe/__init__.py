"""Qwen3-MoE: Qwen3's attention, a mixture of experts as the MLP (``models/moe.py``)."""
from lmforge.models.family import from_folder
from lmforge.models.qwen3_moe import gguf, hf, model, plan, presets  # the family's parts
from lmforge.models.qwen3_moe.model import SparseArgs, SparseBlock, SparseLlama

FAMILY = from_folder(model, hf, plan, presets, name="qwen3_moe", model_types=("qwen3_moe",),
                     build=SparseLlama, args_from_dict=SparseArgs.from_dict,
                     rope_scaling=hf.rope_scaling_from, checkpoint_in=hf.checkpoint_in,
                     checkpoint_out=hf.checkpoint_out,
                     gguf=gguf)

__all__ = ["FAMILY", "SparseArgs", "SparseBlock", "SparseLlama"]
