"""The experts' grouped product: each row of a sorted batch times its expert's weight,
as one ``torch._grouped_mm`` where the device and dtype take it, else one padded batched
product (``models/moe.py`` sorts the rows by expert first)."""
from __future__ import annotations

import functools

import torch


@functools.cache
def grouped_mm_supported(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs forward and backward on this device type and
    dtype (CUDA: bf16 on Hopper and later; torch 2.13's CPU: fp32 and bf16 too), probed
    once on tiny tensors with an empty group, with gradients on even when the first call
    comes under ``no_grad`` (evaluation), so the answer cached holds for training too.
    Its own saved tensors stay its own (identity hooks): a first call inside an
    activation-checkpointed block would otherwise count them among the block's, and the
    recomputation, which finds the answer cached, would save fewer and fail."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    with torch.inference_mode(False), torch.enable_grad(), \
            torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        try:
            x = torch.ones(3, 16, device=device_type, dtype=dtype, requires_grad=True)
            w = torch.ones(2, 16, 16, device=device_type, dtype=dtype, requires_grad=True)
            ends = torch.tensor([0, 3], device=device_type, dtype=torch.int32)
            y = torch._grouped_mm(x, w.transpose(-2, -1), offs=ends)  # (3, 16)
            y.backward(torch.ones_like(y))
            return bool((y == 16).all() and (w.grad[0] == 0).all())
        except (RuntimeError, NotImplementedError, TypeError, ValueError):
            return False


def tokens_per_expert(indices: torch.Tensor, n_experts: int) -> torch.Tensor:
    """(experts,) how many of the (token, k) assignments in ``indices`` each expert got.
    A scatter, not ``bincount``, whose output shape depends on the values (no meta
    kernel, a graph break under ``torch.compile``)."""
    flat = indices.flatten()
    return flat.new_zeros(n_experts).scatter_add_(0, flat, torch.ones_like(flat))


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor,
                   experts: torch.Tensor) -> torch.Tensor:
    """Each row of ``x`` times its expert's weight (out x in): x (assignments, in) sorted
    by expert, ``counts`` (experts,) rows per expert, ``experts`` (assignments,) each
    row's expert. One ``torch._grouped_mm`` where it runs, else one padded batched
    product (each expert's rows padded to the busiest expert's count: a device sync, and
    up to n_experts times the rows' memory when one expert takes them all). Under
    autocast both run in its dtype, as a ``bmm`` would (``_grouped_mm`` is not on
    autocast's list: it would run fp32, or fail on bf16 rows and fp32 weights)."""
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        x, weight = x.to(dtype), weight.to(dtype)
    if _grouped_mm_takes(x, weight):
        ends = counts.cumsum(0).to(torch.int32)  # (experts,) each group's end row
        y = torch._grouped_mm(x, weight.transpose(-2, -1), offs=ends)  # (assignments, out)
        if y.requires_grad:  # its backward refuses an expanded gradient (a plain .sum()'s)
            y.register_hook(torch.Tensor.contiguous)
        return y
    starts = counts.cumsum(0) - counts  # (experts,)
    slot = torch.arange(x.shape[0], device=x.device) - starts[experts]  # (assignments,)
    padded = x.new_zeros(weight.shape[0], int(counts.max()), x.shape[1])  # (experts, most, in)
    padded = padded.index_put((experts, slot), x)
    return torch.bmm(padded, weight.transpose(1, 2))[experts, slot]  # (assignments, out)


def _grouped_mm_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether this product runs as one ``torch._grouped_mm``. Under ``torch.compile``
    only in bf16: its fake kernel (torch 2.13), which tracing runs, refuses the fp32
    that the CPU kernel takes, so a compiled fp32 block takes the padded product."""
    if torch.compiler.is_compiling() and x.dtype != torch.bfloat16:
        return False
    return grouped_mm_supported(x.device.type, x.dtype) and _aligned(x, weight)


def _aligned(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes these operands: it needs every row stride
    a multiple of 16 bytes (an fp32 width of 6 is refused; real models' widths are
    multiples of 64), which the cached probe's 16-wide tensors cannot tell."""
    return all(n * x.element_size() % 16 == 0 for n in (x.shape[1], weight.shape[1]))
