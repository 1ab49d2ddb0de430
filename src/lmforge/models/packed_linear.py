"""Decoding on the CPU with the linear layers' weights in oneDNN's packed layout.

A decoding step multiplies a few rows by every weight matrix, so on the CPU it is bound by
reading the weights. ``F.linear`` hands MKL the row-major weight as it is; the same weight
reordered once into oneDNN's blocked layout (what Inductor's ``freezing`` and IPEX do for
inference) is read much faster: on the 2-core dev machine, one pass over SmolLM2-135M's
matrices took 25 ms packed against 45 ms plain at one row, 23 ms against 70 ms at eight
(docs/benchmarks.md, "Greedy decoding").

``packed_linears`` packs each plain ``nn.Linear``'s weight for the length of one decode and
puts the plain forward back after. The packed copy is a snapshot: nothing may change the
weights while it lives, and nothing does (decoding runs under ``no_grad``; a training step
comes between two rollouts, never during one). Only exact ``nn.Linear`` modules are packed
(LoRA's and the quantized layers' forwards do more than a product), with fp32 weights on the
CPU that are not sharded (a DTensor's local shard is not the whole matrix); the copy
doubles those weights' memory while it lives, so it is skipped when ``budget`` bytes cannot
hold it. Anything not packed decodes exactly as before. The packed product sums in another
order than MKL's: results differ from the plain forward's in the last bits (about 1e-6
relative), as any change of kernel or batch shape makes them.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def packable(module: nn.Module) -> bool:
    """A plain linear layer whose fp32 CPU weight is whole (not sharded), not yet packed."""
    if type(module) is not nn.Linear or "forward" in module.__dict__:
        return False
    w = module.weight
    return (not isinstance(w, DTensor) and w.device.type == "cpu"
            and w.dtype == torch.float32)


@contextlib.contextmanager
def packed_linears(model: nn.Module, rows: int, budget: int) -> Iterator[int]:
    """Pack ``model``'s packable linear layers for products of about ``rows`` rows (oneDNN's
    hint; any number of rows stays correct) while the block runs; yields how many were
    packed (0: none could be, or their copies would not fit in ``budget`` bytes)."""
    modules = [m for m in model.modules() if packable(m)]
    weights = {id(m.weight): m.weight for m in modules}  # (a tied head counts once)
    if not modules or 2 * sum(w.numel() * 4 for w in weights.values()) > budget \
            or not _available():
        yield 0
        return
    packed: dict[int, torch.Tensor] = {}
    try:
        for m in modules:
            key = id(m.weight)
            if key not in packed:
                packed[key] = torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(),
                                                                      max(rows, 1))
            m.forward = _packed_forward(packed[key], m.bias)
        yield len(modules)
    finally:
        for m in modules:
            m.__dict__.pop("forward", None)


def _packed_forward(weight: torch.Tensor, bias):
    bias = None if bias is None else bias.detach()

    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return forward


def _available() -> bool:
    """oneDNN is built in and packs on this CPU (checked once, on a tiny matrix)."""
    if not _CHECKED:
        ok = torch.backends.mkldnn.is_available()
        if ok:
            try:
                w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(4, 4), 1)
                y = torch.ops.mkldnn._linear_pointwise(torch.ones(1, 4), w, None, "none",
                                                       [], "")
                ok = bool((y == 4).all())
            except (RuntimeError, AttributeError):
                ok = False
        _CHECKED.append(ok)
    return _CHECKED[0]


_CHECKED: list = []
