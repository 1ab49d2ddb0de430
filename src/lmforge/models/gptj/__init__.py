"""The GPT-J family (EleutherAI's GPT-J 6B and models of its shape)."""
from lmforge.models.family import from_folder
from lmforge.models.gptj import hf, model, plan, presets  # the family's parts
from lmforge.models.gptj.model import GPTJ, GPTJArgs

FAMILY = from_folder(model, hf, plan, presets, name="gptj", model_types=("gptj",), build=GPTJ,
                     args_from_dict=lambda recorded: GPTJArgs(**recorded),
                     ignored_hf_suffixes=hf.IGNORED_SUFFIXES,
                     gguf="llama.cpp cannot run GPT-J (it names the architecture, but has "
                     "no model for it)")

__all__ = ["FAMILY", "hf", "plan", "presets", "GPTJ", "GPTJArgs"]
