"""The Phi-3 family (Phi-3-mini 4k/128k, Phi-4-mini): fused qkv and gate_up projections,
partial rotary embeddings, LongRoPE."""
from lmforge.models.family import from_folder
from lmforge.models.phi3 import gguf, hf, model, plan, presets  # the family's parts
from lmforge.models.phi3.model import LongRope, Phi3, Phi3Args

FAMILY = from_folder(model, hf, plan, presets, name="phi3", model_types=("phi3",), build=Phi3,
                     args_from_dict=Phi3Args.from_dict, gguf=gguf)

__all__ = ["FAMILY", "LongRope", "Phi3", "Phi3Args", "hf", "plan", "presets"]
