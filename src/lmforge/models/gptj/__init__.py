"""The GPT-J family (EleutherAI's GPT-J 6B and models of its shape)."""
from lmforge.models.gptj import hf, plan, presets  # the family's parts
from lmforge.models.gptj.model import GPTJ, GPTJArgs

__all__ = ["hf", "plan", "presets", "GPTJ", "GPTJArgs"]
