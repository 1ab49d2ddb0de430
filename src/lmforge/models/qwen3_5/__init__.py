"""Qwen3.5's language model: Gated DeltaNet and gated full-attention layers
(``layer_types``), Llama's MLP."""
from lmforge.models.family import from_folder
from lmforge.models.qwen3_5 import gguf, hf, model, plan, presets, vision  # the family's parts
from lmforge.models.qwen3_5.model import Hybrid, HybridArgs, HybridBlock

FAMILY = from_folder(model, hf, plan, presets, name="qwen3_5", model_types=("qwen3_5", "qwen3_5_text"),
                     build=Hybrid, args_from_dict=HybridArgs.from_dict,
                     checkpoint_in=hf.checkpoint_in, checkpoint_out=hf.checkpoint_out,
                     with_directory=vision.with_directory,
                     gguf=gguf)

__all__ = ["FAMILY", "Hybrid", "HybridArgs", "HybridBlock"]
