"""LoRA: low-rank adapters on chosen linear layers, applied from outside by module swap.

``LoraLinear`` is an ``nn.Linear`` (so ``weight``/``bias`` keep their names and base
checkpoints load unchanged, and tensor parallelism's Colwise/RowwiseParallel accept it)
with two more parameters beside the weight::

    y = x W^T + b + scaling * (dropout(x) A^T) B^T      A: (rank, in)  B: (out, rank)
    scaling = alpha / rank    (rsLoRA: alpha / sqrt(rank))

A is Kaiming-uniform and B zero at initialisation, as in peft, so a fresh adapter leaves
the model's outputs unchanged. The order of work in a trainer::

    model = build_model(args)                     # meta device
    prepare_model_for_lora(model, cfg.lora)       # swap + freeze (meta or real)
    ... parallelize, to_empty, init_weights() or load weights ...
    after_materialize(model, cfg.lora)            # init A/B, quantize the base if asked
    load_adapter(model, cfg.lora.adapter_from)    # if set (peft.adapters)
    print(trainable_summary(model))               # "4.2M trainable / 6.74B total (0.06%)"

Which linears get adapters is ``lora.targets`` read by ``peft.targets``; a quantized base
comes from ``peft.quant``, which this module builds on.

Under tensor parallelism ColwiseParallel shards A and B on dim 0 and RowwiseParallel
replicates them; DTensor then computes the adapter path exactly either way. Under FSDP2
the frozen base and the adapters are sharded alike and only the adapters get gradients.
"""
from __future__ import annotations

import contextlib

import math
from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.models.moe import MoE
from lmforge.peft.expert_lora import (LoraGroupedExperts, apply_expert_lora,
                                      init_expert_lora, merge_expert_lora)
from lmforge.peft.quant import QuantizedLinear, quantize_base
from lmforge.peft.quant_experts import quantize_experts
from lmforge.peft.scaling import LORA_PARAM_NAMES, is_lora_param, lora_scaling
from lmforge.peft.summary import count_trainable, trainable_summary  # (re-exported)
from lmforge.peft.targets import model_projections, resolve_targets

__all__ = ["LORA_PARAM_NAMES", "LoraError", "LoraLinear", "adapters_disabled",
           "after_materialize", "apply_lora", "count_trainable", "freeze_base",
           "init_lora_weights", "is_lora_param", "lora_layers", "lora_scaling",
           "merge_lora", "prepare_model_for_lora", "trainable_summary", "unmerge_lora"]

class LoraError(ValueError):
    """A LoRA request cannot be honoured; the message names the field or module."""


class LoraLinear(nn.Linear):
    """A linear layer plus a low-rank update. ``merged``: the update has been added into
    ``weight`` (and is skipped in forward). ``quantized``: a ``QuantizedLinear`` child
    holding the frozen base instead of ``weight`` (QLoRA); ``weight`` is then None."""

    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float,
                 dropout: float = 0.0, rslora: bool = False, bias: bool = False,
                 device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        if rank <= 0:
            raise LoraError(f"lora.rank: must be > 0, got {rank}")
        self.rank, self.alpha, self.rslora, self.dropout = rank, float(alpha), rslora, dropout
        self.lora_a = nn.Parameter(torch.empty(rank, in_features, device=device, dtype=dtype))
        self.lora_b = nn.Parameter(torch.empty(out_features, rank, device=device, dtype=dtype))
        self.merged = False
        self.disabled = False  # the base layer alone (``adapters_disabled``)
        self.quantized: Optional[nn.Module] = None
        if not self.lora_a.is_meta:
            self.reset_lora_parameters()

    @classmethod
    def from_linear(cls, linear: nn.Module, rank: int, alpha: float, dropout: float = 0.0,
                    rslora: bool = False) -> "LoraLinear":
        """Wrap an existing ``nn.Linear`` (or ``QuantizedLinear``), reusing its weight and
        bias tensors: no copy, on whatever device (meta included) they live."""
        quantized = isinstance(linear, QuantizedLinear)
        if quantized:  # adapters train in fp32 beside a quantized base
            device = next(iter(linear.quantized_tensors().values())).device
            dtype = linear.bias.dtype if linear.bias is not None else torch.float32
        else:
            device, dtype = linear.weight.device, linear.weight.dtype
        # Built on meta so nothing is allocated for a weight that is replaced right away.
        new = cls(linear.in_features, linear.out_features, rank, alpha, dropout, rslora,
                  bias=linear.bias is not None, device="meta", dtype=dtype)
        new.bias = linear.bias
        if quantized:
            linear.bias = None  # the bias moves up here, beside the adapter
            new.weight = None
            new.quantized = linear
        else:
            new.weight = linear.weight
        new.lora_a = nn.Parameter(torch.empty_like(new.lora_a, device=device))
        new.lora_b = nn.Parameter(torch.empty_like(new.lora_b, device=device))
        if device.type != "meta":
            new.reset_lora_parameters()
        return new

    @property
    def scaling(self) -> float:
        return lora_scaling(self.alpha, self.rank, self.rslora)

    @torch.no_grad()
    def reset_lora_parameters(self) -> None:
        """peft's default: A Kaiming-uniform (a = sqrt(5), as nn.Linear), B zero."""
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        nn.init.zeros_(self.lora_b)
        self.merged = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            base = self.quantized(x)
            if self.bias is not None:
                base = base + self.bias.to(base.dtype)
        else:
            base = F.linear(x, self.weight, self.bias)
        if self.merged or self.disabled:
            return base
        h = F.dropout(x, self.dropout, self.training) if self.dropout else x
        update = F.linear(F.linear(h.to(self.lora_a.dtype), self.lora_a), self.lora_b)
        return base + (update * self.scaling).to(base.dtype)

    def delta_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """scaling * B A, the (out, in) update merging adds to the weight."""
        return ((self.lora_b.to(dtype) @ self.lora_a.to(dtype)) * self.scaling)

    @torch.no_grad()
    def merge(self) -> None:
        """Add the update into ``weight``; forward then skips the adapter path."""
        if self.merged:
            return
        self._refuse_quantized("merge")
        self.weight.add_(_like(self.delta_weight(), self.weight))
        self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """Subtract the update again (exact up to floating-point rounding)."""
        if not self.merged:
            return
        self._refuse_quantized("unmerge")
        self.weight.sub_(_like(self.delta_weight(), self.weight))
        self.merged = False

    def base_weight(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The frozen base weight, dequantized when quantized (in ``dtype``)."""
        if self.quantized is not None:
            return self.quantized.dequantize(dtype or torch.float32)
        w = self.weight.detach()
        return w if dtype is None else w.to(dtype)

    def quantize_base(self, fmt: str, double_quant: bool = True, device=None) -> None:
        """Move the base weight into a ``QuantizedLinear`` child (``quant``'s
        ``HoldsQuantizableBase``); the adapters stay in full precision."""
        if self.merged:
            raise LoraError(f"{fmt} quantization of a merged LoRA layer would bake the "
                            f"adapter into the frozen base; unmerge first")
        plain = nn.Linear(self.in_features, self.out_features, bias=False, device="meta")
        plain.weight, plain.bias = self.weight, None  # the bias stays here, unquantized
        self.quantized = QuantizedLinear.from_linear(plain, fmt, double_quant, device)
        self.weight = None

    def dequantize_base(self, dtype: torch.dtype = torch.bfloat16) -> None:
        if self.quantized is None:
            return
        self.weight = nn.Parameter(self.quantized.dequantize(dtype), requires_grad=False)
        self.quantized = None

    def _refuse_quantized(self, action: str) -> None:
        if self.quantized is not None:
            raise LoraError(f"cannot {action} LoRA into a {self.quantized.fmt}-quantized base "
                            f"weight; dequantize it to 16-bit first (dequantize_base) or "
                            f"export with export_merged, which does")

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha:g}, "
                f"rslora={self.rslora}, dropout={self.dropout:g}, merged={self.merged}"
                + (f", base={self.quantized.fmt}" if self.quantized is not None else ""))


def _like(delta: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``delta`` in ``weight``'s dtype and, for DTensors, its placements."""
    delta = delta.to(weight.dtype)
    placements = getattr(weight, "placements", None)
    if placements is not None and getattr(delta, "placements", None) != placements:
        delta = delta.redistribute(weight.device_mesh, placements)
    return delta


# ------------------------------------------------------------------ whole-model API

def apply_lora(model: nn.Module, cfg, module_names: Optional[Iterable[str]] = None
               ) -> list[str]:
    """Swap every target linear of ``model`` for a ``LoraLinear`` (meta or real model).

    ``cfg`` has ``rank``, ``alpha``, ``dropout``, ``rslora`` and ``targets`` (a
    ``lmforge.config.LoraConfig``; targets as ``peft.targets`` reads them).
    ``module_names`` (full module names) overrides ``targets``. Layers already LoRA are
    left alone. Returns the swapped module names."""
    experts: list[str] = []
    if module_names is not None:
        wanted = set(module_names)
        match = lambda name: name in wanted  # noqa: E731
    else:
        projections = model_projections(model)
        resolved = resolve_targets(cfg.targets, projections)
        leaves = set(resolved) - set(projections.experts)
        experts = [t.removeprefix("experts.") for t in resolved if t in projections.experts]
        match = lambda name: name.rsplit(".", 1)[-1] in leaves  # noqa: E731
    swapped = _swap_linears(model, cfg, match)
    if experts:
        swapped += _adapt_experts(model, cfg, experts)
    if not swapped and not any(isinstance(m, (LoraLinear, LoraGroupedExperts))
                               for m in model.modules()):
        what = sorted(module_names) if module_names is not None else cfg.targets
        raise LoraError(f"lora.targets: no module of the model matches {what}")
    return swapped


def _swap_linears(model: nn.Module, cfg, match) -> list[str]:
    swapped = []
    for name, module in list(model.named_modules()):
        if not match(name) or isinstance(module, LoraLinear):
            continue
        if type(module) is not nn.Linear and not isinstance(module, QuantizedLinear):
            raise LoraError(f"lora.targets: {name} is a {type(module).__name__}, not a linear "
                            f"layer")
        new = LoraLinear.from_linear(module, cfg.rank, cfg.alpha, cfg.dropout, cfg.rslora)
        model.set_submodule(name, new)
        swapped.append(name)
    return swapped


def _adapt_experts(model: nn.Module, cfg, targets: list[str]) -> list[str]:
    """Adapters on ``targets`` (``gate_up_proj``, ``down_proj``) of every MoE layer's
    experts without them yet; returns the experts modules' names."""
    adapted = []
    for name, module in list(model.named_modules()):
        if isinstance(module, MoE) and not isinstance(module.experts, LoraGroupedExperts):
            try:
                apply_expert_lora(module, targets, cfg.rank, cfg.alpha, cfg.dropout,
                                  cfg.rslora)
            except ValueError as e:
                raise LoraError(f"lora: {name}.experts: {e}") from None
            adapted.append(f"{name}.experts")
    return adapted


def freeze_base(model: nn.Module) -> None:
    """Only LoRA parameters train; everything else is frozen."""
    for name, p in model.named_parameters():
        p.requires_grad_(is_lora_param(name))


def lora_layers(model: nn.Module) -> dict[str, LoraLinear]:
    """The LoRA linear layers (the experts' adapters: ``expert_layers``)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLinear)}


def expert_layers(model: nn.Module) -> dict[str, LoraGroupedExperts]:
    """The MoE layers' experts that carry adapters, by module name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraGroupedExperts)}


@torch.no_grad()
def init_lora_weights(model: nn.Module) -> None:
    """A Kaiming-uniform, B zero in every LoRA layer and expert adapter: call after
    ``to_empty``."""
    for layer in lora_layers(model).values():
        layer.reset_lora_parameters()
    init_expert_lora(model)


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """The base model inside the block: every LoRA layer computes its base alone (the
    reference model of DPO and IPO under LoRA, with no second copy in memory)."""
    layers = list(lora_layers(model).values()) + list(expert_layers(model).values())
    if any(getattr(layer, "merged", False) for layer in layers):
        raise LoraError("adapters merged into the weights cannot be switched off")
    for layer in layers:
        layer.disabled = True
    try:
        yield model
    finally:
        for layer in layers:
            layer.disabled = False


def merge_lora(model: nn.Module) -> int:
    """Merge every adapter into its base weight; returns how many layers were merged.
    Refuses a quantized base (see ``dequantize_base`` / ``export_merged``). The experts'
    adapters are merged for good (plain experts are put back; ``unmerge_lora`` cannot
    take them out again)."""
    layers = lora_layers(model)
    moes = [m for m in model.modules()
            if isinstance(m, MoE) and isinstance(m.experts, LoraGroupedExperts)]
    quantized = next((m.experts for m in moes if m.experts.quantized is not None), None)
    if quantized is not None:  # refused before anything is merged
        raise LoraError(f"cannot merge LoRA into {quantized.quantized_format()}-quantized "
                        f"expert stacks; dequantize them to 16-bit first (dequantize_base) "
                        f"or export with export_merged, which does")
    for layer in layers.values():
        layer.merge()
    for moe in moes:
        merge_expert_lora(moe)
    return len(layers) + len(moes)


def unmerge_lora(model: nn.Module) -> int:
    layers = lora_layers(model)
    for layer in layers.values():
        layer.unmerge()
    return len(layers)


def prepare_model_for_lora(model: nn.Module, cfg) -> list[str]:
    """Swap target linears for LoRA layers and freeze everything else. Works on a meta
    model (call ``after_materialize`` once the weights are real) or a loaded one."""
    swapped = apply_lora(model, cfg)
    freeze_base(model)
    return swapped


def after_materialize(model: nn.Module, cfg, init_lora: bool = True) -> None:
    """After ``to_empty`` + weight init/load: initialise A and B (skip with
    ``init_lora=False`` when an adapter or checkpoint is loaded next) and quantize the
    frozen base when ``cfg.quantize`` is set. Freezes the base again (quantization adds
    new frozen parameters). An adapter to start from (``cfg.adapter_from``) is loaded
    next, by ``peft.adapters.load_adapter``.

    Quantization needs real, unsharded weights: with ``cfg.quantize`` call this before
    tensor parallelism / FSDP2 (load -> after_materialize -> fully_shard). Without it, it
    may run after sharding too (initialising sharded adapters is fine)."""
    if init_lora:
        init_lora_weights(model)
    if getattr(cfg, "quantize", None):  # the linears, and an MoE's expert stacks
        quantize_base(model, cfg.quantize, "all-linear")
        quantize_experts(model, cfg.quantize, "all-linear")
    freeze_base(model)
