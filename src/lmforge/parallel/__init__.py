"""Parallelism applied from outside the model: mesh, tensor, FSDP2 and pipeline."""
from __future__ import annotations

import torch


def full_value(t: torch.Tensor) -> torch.Tensor:
    """``t``'s whole value, detached from autograd: a DTensor (TP-, FSDP- or loss-parallel
    sharded or replicated) is gathered; a plain tensor comes back as it is."""
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t
