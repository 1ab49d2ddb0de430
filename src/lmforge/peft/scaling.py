"""What every LoRA adapter shares, linear or on grouped experts (``peft.lora``,
``peft.expert_lora``): its parameters' names, peft's key prefix, the scaling of B A, and
how a loaded value reaches a (possibly sharded) parameter."""
from __future__ import annotations

import math

import torch

LORA_PARAM_NAMES = ("lora_a", "lora_b")
PEFT_PREFIX = "base_model.model."  # before the HF module name in peft's adapter keys


def lora_scaling(alpha: float, rank: int, rslora: bool) -> float:
    """The factor of B A: alpha / rank, or rsLoRA's alpha / sqrt(rank) (peft's rule, for
    linear layers and grouped experts alike)."""
    return alpha / (math.sqrt(rank) if rslora else rank)


def is_lora_param(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in LORA_PARAM_NAMES


@torch.no_grad()
def copy_into(param: torch.Tensor, value: torch.Tensor) -> None:
    """``value`` (whole, from an adapter file) into ``param``, in its dtype and device and,
    for a DTensor, sharded as it is."""
    local = param.to_local() if hasattr(param, "to_local") else param
    value = value.to(device=local.device, dtype=param.dtype)
    placements = getattr(param, "placements", None)
    if placements is not None:
        from torch.distributed.tensor import distribute_tensor

        value = distribute_tensor(value, param.device_mesh, placements)
    param.copy_(value)
