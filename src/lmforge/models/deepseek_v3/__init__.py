"""DeepSeek-V3 (V3, R1, Moonlight): multi-head latent attention, a mixture of experts with
sigmoid group-limited routing and shared experts after the first dense layers."""
from lmforge.models.deepseek_v3 import gguf, hf, model, plan, presets  # the family's parts
from lmforge.models.deepseek_v3.model import DeepseekV3, DeepseekV3Args, DeepseekV3Block
from lmforge.models.family import from_folder

FAMILY = from_folder(model, hf, plan, presets, name="deepseek_v3",
                     model_types=("deepseek_v3",), build=DeepseekV3,
                     args_from_dict=DeepseekV3Args.from_dict, checkpoint_in=hf.checkpoint_in,
                     checkpoint_out=hf.checkpoint_out,
                     gguf=gguf)

__all__ = ["FAMILY", "DeepseekV3", "DeepseekV3Args", "DeepseekV3Block"]
