"""What every LoRA adapter shares, linear or on grouped experts (``peft.lora``,
``peft.expert_lora``): its parameters' names and the scaling of B A."""
from __future__ import annotations

import math

LORA_PARAM_NAMES = ("lora_a", "lora_b")


def lora_scaling(alpha: float, rank: int, rslora: bool) -> float:
    """The factor of B A: alpha / rank, or rsLoRA's alpha / sqrt(rank) (peft's rule, for
    linear layers and grouped experts alike)."""
    return alpha / (math.sqrt(rank) if rslora else rank)


def is_lora_param(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in LORA_PARAM_NAMES
