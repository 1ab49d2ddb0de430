"""The Gemma 3 family (text): four norms per block, q/k norms, GeGLU, scaled embeddings,
sliding-window layers interleaved with global ones."""
from lmforge.models.family import from_folder
from lmforge.models.gemma3 import gguf, hf, model, plan, presets  # the family's parts
from lmforge.models.gemma3.model import Gemma3, Gemma3Args

FAMILY = from_folder(model, hf, plan, presets, name="gemma3", model_types=("gemma3_text",),
                     build=Gemma3, args_from_dict=Gemma3Args.from_dict, gguf=gguf)

__all__ = ["FAMILY", "Gemma3", "Gemma3Args", "hf", "plan", "presets"]
