"""Parameter counts of a model under LoRA/QLoRA: trainable against total, a quantized
weight (a linear's or an expert stack's) counted as the weights it stands for, and a
mixture of experts' trainable parameters by kind."""
from __future__ import annotations

import torch
from torch import nn

from lmforge.models.moe import MoE
from lmforge.peft.quant import QuantizedLinear
from lmforge.peft.quant_experts import QuantizedStack


def count_trainable(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts. Tied tensors count once; a quantized layer
    counts the weights it stands for, not its packed bytes."""
    seen: dict[int, torch.Tensor] = {}
    storage: set[int] = set()
    total = 0
    for m in model.modules():
        if isinstance(m, (QuantizedLinear, QuantizedStack)):
            total += (m.in_features * m.out_features if isinstance(m, QuantizedLinear)
                      else m.numel())
            storage.update(id(t) for t in m.quantized_tensors().values())
    for p in model.parameters():
        if id(p) not in storage:
            seen[id(p)] = p
    total += sum(p.numel() for p in seen.values())
    trainable = sum(p.numel() for p in seen.values() if p.requires_grad)
    return trainable, total


def trainable_summary(model: nn.Module) -> str:
    """e.g. ``4.19M trainable / 6.74B total (0.06%)``; a mixture of experts' adds the
    trainable parameters by kind (``attention 1.2M, experts 3.1M, ...``), so that a user
    sees whether the experts learn."""
    trainable, total = count_trainable(model)
    share = 100.0 * trainable / max(total, 1)
    line = f"{_human(trainable)} trainable / {_human(total)} total ({share:.2f}%)"
    if not any(isinstance(m, MoE) for m in model.modules()):
        return line
    kinds = trainable_by_kind(model)
    return line + ": " + ", ".join(f"{kind} {_human(n)}" for kind, n in kinds.items())


# A kind and the part of a parameter's name that says it, in the order they are told
# apart (a dense MLP's parameters are the feed-forward's that are none of the others').
_KINDS = (("attention", ".attention."), ("experts", ".experts."),
          ("shared experts", ".shared_experts."), ("router", ".feed_forward.gate."),
          ("mlp", ".feed_forward."))


def trainable_by_kind(model: nn.Module) -> dict[str, int]:
    """Trainable parameters by kind: attention, mlp (dense layers), experts, shared
    experts, router, other (embedding, norms, head); the kinds with none left out."""
    counts = dict.fromkeys(("attention", "mlp", "experts", "shared experts", "router",
                            "other"), 0)
    seen = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        kind = next((k for k, part in _KINDS if part in f".{name}"), "other")
        counts[kind] += p.numel()
    return {kind: n for kind, n in counts.items() if n}


def _human(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)
