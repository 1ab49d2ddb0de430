"""Qwen3.5-MoE's language model: Qwen3-Next's model (``models/qwen3_next``: Qwen3.5's hybrid
layers, a mixture of experts and a gated shared expert on every layer), with Qwen3.5's
separate linear-layer projections in its checkpoints and its own config fields. The Hub's
checkpoints are image-text models (``Qwen3_5MoeForConditionalGeneration``): their vision
tower is kept and written back as Qwen3.5's (``models/qwen3_5/vision.py``)."""
from lmforge.models.family import from_folder
from lmforge.models.qwen3_5 import vision
from lmforge.models.qwen3_5_moe import gguf, hf, presets  # the family's parts
from lmforge.models.qwen3_next import model, plan
from lmforge.models.qwen3_next.model import HybridSparse, HybridSparseArgs

FAMILY = from_folder(model, hf, plan, presets, name="qwen3_5_moe",
                     model_types=("qwen3_5_moe", "qwen3_5_moe_text"), build=HybridSparse,
                     args_from_dict=HybridSparseArgs.from_dict,
                     checkpoint_in=hf.checkpoint_in, checkpoint_out=hf.checkpoint_out,
                     with_directory=vision.with_directory, gguf=gguf)

__all__ = ["FAMILY"]
