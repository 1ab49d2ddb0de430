"""Mixtral: Mistral's attention (a sliding window when config.json sets one), a mixture of
experts as the MLP on every layer. The model and its tensor-parallel plan are
Qwen3-MoE's (``models/qwen3_moe``: ``SparseLlama``), with no dense layers and the top-k
weights always renormalised."""
from lmforge.models.family import from_folder
from lmforge.models.mixtral import gguf, hf, presets  # the family's parts
from lmforge.models.qwen3_moe import model, plan
from lmforge.models.qwen3_moe.model import SparseArgs, SparseLlama

FAMILY = from_folder(model, hf, plan, presets, name="mixtral", model_types=("mixtral",),
                     build=SparseLlama, args_from_dict=SparseArgs.from_dict,
                     rope_scaling=hf.rope_scaling_from, checkpoint_in=hf.checkpoint_in,
                     checkpoint_out=hf.checkpoint_out,
                     gguf=gguf)

__all__ = ["FAMILY"]
