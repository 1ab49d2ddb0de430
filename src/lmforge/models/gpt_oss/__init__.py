"""gpt-oss: attention with biases and per-head sinks, sliding and global layers in turn,
YaRN, and a mixture of experts with a biased top-k router and clamped SwiGLU experts;
released checkpoints' MXFP4 experts dequantized on load."""
from lmforge.models.family import from_folder
from lmforge.models.gpt_oss import gguf, hf, model, plan, presets  # the family's parts
from lmforge.models.gpt_oss.model import GptOss, GptOssArgs, GptOssBlock
from lmforge.models.llama.hf import rope_scaling_from

FAMILY = from_folder(model, hf, plan, presets, name="gpt_oss", model_types=("gpt_oss",),
                     build=GptOss, args_from_dict=GptOssArgs.from_dict,
                     rope_scaling=rope_scaling_from, checkpoint_in=hf.checkpoint_in,
                     checkpoint_out=hf.checkpoint_out, expert_layout="gpt_oss",
                     gguf=gguf)

__all__ = ["FAMILY", "GptOss", "GptOssArgs", "GptOssBlock"]
