"""The Llama family: Llama 2/3/3.1/3.2, and Mistral, Qwen2/2.5 and Qwen3, which are Llama
with flags (a sliding window, q/k/v biases, q/k norms, an explicit head_dim)."""
from lmforge.models.common import count_parameters, materialize
from lmforge.models.family import from_folder
from lmforge.models.llama import gguf, hf, model, plan, presets  # the family's parts
from lmforge.models.llama.model import (Attention, FeedForward, Llama, LlamaArgs, RMSNorm,
                                        RopeScaling, TransformerBlock, apply_rope,
                                        build_llama, rope_cos_sin)

FAMILY = from_folder(model, hf, plan, presets, name="llama",
                     model_types=("llama", "mistral", "qwen2", "qwen3"), build=Llama,
                     args_from_dict=LlamaArgs.from_dict, as_variant=hf.as_variant, gguf=gguf,
                     rope_scaling=hf.rope_scaling_from)

__all__ = ["FAMILY", "hf", "plan", "presets", "Attention", "FeedForward", "Llama",
           "LlamaArgs", "RMSNorm", "RopeScaling", "TransformerBlock", "apply_rope",
           "build_llama", "count_parameters", "materialize", "rope_cos_sin"]
