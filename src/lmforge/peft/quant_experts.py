"""QLoRA's frozen base for a mixture of experts: the stacked expert weights
``experts.gate_up_proj`` (experts, 2 ffn, dim) and ``experts.down_proj`` (experts, dim,
ffn) in NF4 or int8, dequantized on every forward by ``GroupedExperts.weight_of``.

Each expert is quantized on its own, as ``quant`` quantizes a linear's weight: NF4 in
blocks of 64 values along the input dim (its rows, flattened; the absmaxes double-quantized
in groups of 256, per expert), int8 per output row. So every stored part has the experts on
dim 0, as the stacks do, and expert parallelism shards them alike. A ``QuantizedStack``
holds one stack's parts as frozen parameters ``weight_<part>`` (uint8/int8 codes, fp32
scales), so ``to``, ``to_empty``, FSDP2 and checkpoints take them like any other.

``QuantizableExperts`` is the ``GroupedExperts`` whose stacks may be stored so (in
``quantized``, by name); the LoRA experts (``expert_lora.LoraGroupedExperts``) build on it,
folding their adapters into the dequantized stack. ``quantize_experts`` swaps a model's
plain experts for it and quantizes the chosen stacks; ``quant.dequantize_base`` undoes it
(the module quacks as ``quant.HoldsQuantizableBase``).

Unlike ``quant.QuantizedLinear``, the dequantized stack is a tensor the grouped product
keeps for its backward (one stack's size per layer, as the LoRA fold already keeps); a
custom backward that dequantizes again is left for when it is measured.
"""
from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.models.moe import GroupedExperts
from lmforge.parallel import full_value
from lmforge.peft.quant import (NF4_BLOCK, SCALE_GROUP, QuantizationError, _check_format,
                                _int8_quantize, _is_dtensor, _nf4_quantize, _pair_table)
from lmforge.peft.targets import model_projections, resolve_targets

STACKS = ("gate_up_proj", "down_proj")


class QuantizedStack(nn.Module):
    """A frozen (experts, out, in) stack, each expert quantized on its own. ``base_dtype``:
    the stack's dtype before quantization, what a forward dequantizes to."""

    def __init__(self, shape: Sequence[int], fmt: str, tensors: dict[str, torch.Tensor],
                 base_dtype: torch.dtype):
        super().__init__()
        _check_format(fmt)
        self.shape, self.fmt, self.base_dtype = tuple(shape), fmt, base_dtype
        self._parts = tuple(tensors)
        for part, t in tensors.items():
            self.register_parameter(f"weight_{part}", nn.Parameter(t, requires_grad=False))

    @classmethod
    def from_weight(cls, weight: torch.Tensor, fmt: str, double_quant: bool = True,
                    device=None) -> "QuantizedStack":
        if weight.is_meta:
            raise QuantizationError("quantize_experts: the model is on the meta device; "
                                    "quantize after its weights are loaded")
        if _is_dtensor(weight):
            raise QuantizationError("quantize_experts: quantize before expert parallelism "
                                    "or FSDP is applied (the stack is already a DTensor)")
        w = weight.detach() if device is None else weight.detach().to(device)
        if fmt == "int8":  # per output row: one row of the (experts * out, in) matrix
            tensors = {k: t.view(w.shape[0], w.shape[1], *t.shape[1:])  # (experts, out, ...)
                       for k, t in _int8_quantize(w.reshape(-1, w.shape[-1])).items()}
        else:
            per_expert = [_nf4_quantize(expert, double_quant) for expert in w]
            tensors = {k: torch.stack([p[k] for p in per_expert]) for k in per_expert[0]}
        return cls(w.shape, fmt, tensors, weight.dtype)

    def quantized_tensors(self) -> dict[str, torch.Tensor]:
        return {part: getattr(self, f"weight_{part}") for part in self._parts}

    def device(self) -> torch.device:
        return self._parameters[f"weight_{self._parts[0]}"].device

    def numel(self) -> int:
        """The values of the stack it stands for."""
        return self.shape[0] * self.shape[1] * self.shape[2]

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The (experts, out, in) stack in ``dtype`` (default ``base_dtype``)."""
        # outside FSDP's forward (e.g. exporting) sharded tensors are gathered first
        t = {k: full_value(v) for k, v in self.quantized_tensors().items()}
        dtype = dtype or self.base_dtype
        if self.fmt == "int8":
            return (t["int8"].float() * t["scale"].float()[..., None]).view(
                self.shape).to(dtype)
        return _nf4_stack(t, self.shape).to(dtype)

    def extra_repr(self) -> str:
        return f"shape={self.shape}, fmt={self.fmt}, base_dtype={self.base_dtype}"


def _nf4_stack(t: dict[str, torch.Tensor], shape: tuple[int, int, int]) -> torch.Tensor:
    """``quant._nf4_dequantize`` for every expert at once (fp32)."""
    packed = t["nf4"]  # (experts, padded / 2)
    n_experts = packed.shape[0]
    values = _pair_table(packed.device).index_select(0, packed.reshape(-1).int())
    values = values.view(n_experts, -1, NF4_BLOCK)  # (experts, blocks, 64)
    if "absmax" in t:
        absmax = t["absmax"].float()  # (experts, blocks)
    else:
        q = t["absmax_int8"].float()  # (experts, blocks)
        q = F.pad(q, (0, (-q.shape[1]) % SCALE_GROUP)).view(n_experts, -1, SCALE_GROUP)
        absmax = (q * t["absmax_scale"].float()[..., None]).flatten(1)[:, :values.shape[1]]
        absmax = absmax + t["absmax_mean"].float()  # (experts, 1) broadcast
    weight = (values * absmax[..., None]).flatten(1)[:, :shape[1] * shape[2]]
    return weight.view(shape)


class QuantizableExperts(GroupedExperts):
    """``GroupedExperts`` whose stacks may be stored quantized (``quantized``: stack name
    -> ``QuantizedStack``, the parameter itself then None; None when none is)."""

    @classmethod
    def wrap(cls, experts: GroupedExperts) -> "QuantizableExperts":
        """A ``cls`` holding ``experts``' tensors (no copy; meta stays meta), quantized
        stacks included."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.args = experts.args
        for name in (*STACKS, "gate_up_proj_bias", "down_proj_bias"):
            new.register_parameter(name, getattr(experts, name))
        new.quantized = getattr(experts, "quantized", None)
        return new

    def quantized_format(self) -> Optional[str]:
        return None if self.quantized is None else next(iter(self.quantized.values())).fmt

    def is_quantized(self, name: str) -> bool:
        return self.quantized is not None and name in self.quantized

    def stack_shape(self, name: str) -> tuple[int, int, int]:
        return (self.quantized[name].shape if self.is_quantized(name)
                else tuple(getattr(self, name).shape))

    def base_weight(self, name: str, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The frozen stack ``name``, dequantized when quantized (in ``dtype``; default:
        autocast's when on, else the stack's own)."""
        if not self.is_quantized(name):
            weight = getattr(self, name)
            return weight if dtype is None else weight.to(dtype)
        stack = self.quantized[name]
        device = stack.device()
        if dtype is None and torch.is_autocast_enabled(device.type):
            dtype = torch.get_autocast_dtype(device.type)
        return stack.dequantize(dtype)

    def weight_of(self, name: str) -> torch.Tensor:
        return self.base_weight(name)

    def quantize_base(self, fmt: str, double_quant: bool = True, device=None,
                      names: Iterable[str] = STACKS) -> list[str]:
        """Move the stacks ``names`` (not yet quantized) into ``QuantizedStack``s; returns
        those moved."""
        done = [n for n in names if n in STACKS and not self.is_quantized(n)]
        for name in done:
            stack = QuantizedStack.from_weight(getattr(self, name), fmt, double_quant, device)
            if self.quantized is None:
                self.quantized = nn.ModuleDict()
            self.quantized[name] = stack
            self.register_parameter(name, None)
        return done

    def dequantize_base(self, dtype: torch.dtype = torch.bfloat16) -> None:
        """Plain ``dtype`` stacks again (the rounding stays)."""
        for name, stack in list((self.quantized or {}).items()):
            self.register_parameter(name, nn.Parameter(stack.dequantize(dtype),
                                                       requires_grad=False))
        self.quantized = None


def quantize_experts(model: nn.Module, fmt: str, targets: Iterable[str] | str = "all-linear",
                     double_quant: bool = True, device=None) -> list[str]:
    """Quantize the frozen stacks of every MoE layer's experts that ``targets`` name
    (``peft.targets``: "all-linear" takes both stacks, as it adapts them), swapping plain
    ``GroupedExperts`` for ``QuantizableExperts``. Run it where ``quant.quantize_base``
    runs (after loading, before sharding). Returns the experts modules' names."""
    _check_format(fmt)
    projections = model_projections(model)
    names = [t.removeprefix("experts.") for t in resolve_targets(targets, projections)
             if t in projections.experts]
    done = []
    for name, module in list(model.named_modules()) if names else ():
        if not isinstance(module, GroupedExperts):
            continue
        if not isinstance(module, QuantizableExperts):
            module = QuantizableExperts.wrap(module)
            model.set_submodule(name, module)
        if module.quantize_base(fmt, double_quant, device, names):
            done.append(name)
    return done


def stacks_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, QuantizedStack) for m in model.modules())
