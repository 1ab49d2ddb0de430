"""Frozen base weights in NF4 (QLoRA) or int8, dequantized on the fly in forward.

Applied from outside like LoRA: ``quantize_base(model, "nf4")`` swaps the chosen
``nn.Linear`` layers of a materialised model for ``QuantizedLinear`` (a layer that holds
its base beside weights of its own, ``HoldsQuantizableBase``, moves that base into a
``QuantizedLinear`` child itself), so the model code knows nothing about it. Nothing here
knows LoRA: ``peft.lora`` builds on this module, not the other way round.

NF4 follows QLoRA (Dettmers et al., 2023): the weight is cut into blocks of 64 values, each
block divided by its absolute maximum and rounded to the nearest of 16 levels placed at
quantiles of a standard normal; with double quantization the per-block maxima are
themselves stored as int8 in groups of 256. Two 4-bit codes share a byte. int8 is
symmetric per output row. Neither needs a package beyond torch and both run on the CPU.

The quantized tensors are frozen ``nn.Parameter``s of plain dtypes (uint8/int8 codes, fp32
scales), so ``to``, ``to_empty``, FSDP2 (which shards and all-gathers them as bytes without
casting) and distributed checkpoints handle them like any other parameter. The forward
dequantizes inside a custom autograd function that keeps no 16-bit copy of the weight for
backward: it dequantizes again there, so activation memory stays that of the codes.
Tensor parallelism over a quantized layer is not supported (config validation refuses
LoRA with parallel.tp > 1).
"""
from __future__ import annotations

from typing import Iterable, Optional, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.config import QUANTIZE_FORMATS
from lmforge.parallel import full_value
from lmforge.peft.targets import model_projections, resolve_targets

# The 16 NF4 levels (QLoRA, appendix E): 8 positive and 7 negative quantiles of N(0, 1)
# at evenly spaced probabilities in [0.5, 0.9677], normalised to [-1, 1], plus an exact 0.
# ``nf4_levels_from_quantiles`` recomputes them; a test checks the two agree.
NF4_LEVELS = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)
NF4_BLOCK = 64  # values sharing one absmax
SCALE_GROUP = 256  # absmaxes sharing one int8 scale (double quantization)


class QuantizationError(ValueError):
    """Quantization was asked for something it cannot do; the message says what."""


def nf4_levels_from_quantiles(offset: float = 0.9677083) -> torch.Tensor:
    """The NF4 levels derived from normal quantiles (float64)."""
    ndtri = torch.special.ndtri
    positive = ndtri(torch.linspace(offset, 0.5, 9, dtype=torch.float64)[:-1])
    negative = -ndtri(torch.linspace(offset, 0.5, 8, dtype=torch.float64)[:-1])
    levels = torch.cat([positive, torch.zeros(1, dtype=torch.float64), negative]).sort().values
    return levels / levels.abs().max()


# ------------------------------------------------------------------------- formats

def _nf4_quantize(weight: torch.Tensor, double_quant: bool) -> dict[str, torch.Tensor]:
    flat = weight.detach().reshape(-1).float()
    padded = _pad_to(flat, NF4_BLOCK)  # zeros pad the last block; sliced off on the way back
    blocks = padded.view(-1, NF4_BLOCK)
    absmax = blocks.abs().amax(dim=1)  # (n_blocks,)
    normed = blocks / absmax.clamp_min(torch.finfo(torch.float32).tiny)[:, None]
    levels = torch.tensor(NF4_LEVELS, device=flat.device)
    # Nearest level = the number of midpoints below the value.
    codes = torch.bucketize(normed.reshape(-1), (levels[1:] + levels[:-1]) / 2)
    codes = codes.to(torch.uint8)
    packed = (codes[0::2] << 4) | codes[1::2]  # (numel / 2,) two codes per byte
    out = {"nf4": packed}
    if not double_quant:
        out["absmax"] = absmax
        return out
    mean = absmax.mean()
    centred = _pad_to(absmax - mean, SCALE_GROUP).view(-1, SCALE_GROUP)
    group_scale = centred.abs().amax(dim=1) / 127  # (n_groups,)
    q = torch.round(centred / group_scale.clamp_min(torch.finfo(torch.float32).tiny)[:, None])
    out["absmax_int8"] = q.clamp(-127, 127).to(torch.int8).reshape(-1)[:absmax.numel()]
    out["absmax_scale"] = group_scale
    out["absmax_mean"] = mean.reshape(1)
    return out


_PAIR_TABLES: dict[torch.device, torch.Tensor] = {}


def _pair_table(device: torch.device) -> torch.Tensor:
    """(256, 2) fp32: byte -> the two levels it packs, so one gather decodes two values."""
    table = _PAIR_TABLES.get(device)
    if table is None:
        levels = torch.tensor(NF4_LEVELS, dtype=torch.float32)
        byte = torch.arange(256)
        table = torch.stack([levels[byte >> 4], levels[byte & 0x0F]], dim=1).to(device)
        _PAIR_TABLES[device] = table
    return table


def _nf4_dequantize(t: dict[str, torch.Tensor], shape: tuple[int, int],
                    dtype: torch.dtype) -> torch.Tensor:
    packed = t["nf4"]
    # index_select, not table[idx]: advanced indexing of table rows is ~100x slower on CPU.
    values = _pair_table(packed.device).index_select(0, packed.int()).view(-1, NF4_BLOCK)
    if "absmax" in t:
        absmax = t["absmax"].float()
    else:
        q = _pad_to(t["absmax_int8"].float(), SCALE_GROUP).view(-1, SCALE_GROUP)
        absmax = (q * t["absmax_scale"].float()[:, None]).reshape(-1)[:values.shape[0]]
        absmax = absmax + t["absmax_mean"].float()
    weight = (values * absmax[:, None]).reshape(-1)[:shape[0] * shape[1]]
    return weight.view(shape).to(dtype)


def _int8_quantize(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127  # (out,) one scale per output row
    q = torch.round(w / scale.clamp_min(torch.finfo(torch.float32).tiny)[:, None])
    return {"int8": q.clamp(-127, 127).to(torch.int8), "scale": scale}


def _int8_dequantize(t: dict[str, torch.Tensor], shape: tuple[int, int],
                     dtype: torch.dtype) -> torch.Tensor:
    return (t["int8"].float() * t["scale"].float()[:, None]).to(dtype)


def _pad_to(flat: torch.Tensor, multiple: int) -> torch.Tensor:
    extra = (-flat.numel()) % multiple
    return F.pad(flat, (0, extra)) if extra else flat


# -------------------------------------------------------------------------- module

class QuantizedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` stored quantized and frozen. Parameters are named
    ``weight_<part>`` (e.g. ``weight_nf4``, ``weight_absmax_int8``); ``bias`` stays 16/32-bit.
    """

    def __init__(self, in_features: int, out_features: int, fmt: str,
                 tensors: dict[str, torch.Tensor], bias: Optional[torch.Tensor] = None):
        super().__init__()
        _check_format(fmt)
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        self._parts = tuple(tensors)
        for part, t in tensors.items():
            self.register_parameter(f"weight_{part}", nn.Parameter(t, requires_grad=False))
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: str, double_quant: bool = True,
                    device=None) -> "QuantizedLinear":
        """``device``: where to quantize and keep the codes (default: the weight's)."""
        w = linear.weight
        if w.is_meta:
            raise QuantizationError("quantize_base: the model is on the meta device; "
                                    "quantize after its weights are loaded")
        if _is_dtensor(w):
            raise QuantizationError("quantize_base: quantize before tensor parallelism or "
                                    "FSDP is applied (the weight is already a DTensor)")
        if device is not None:
            w = w.detach().to(device)
        tensors = _nf4_quantize(w, double_quant) if fmt == "nf4" else _int8_quantize(w)
        bias = linear.bias if linear.bias is None or device is None else linear.bias.to(device)
        return cls(linear.in_features, linear.out_features, fmt, tensors, bias)

    def quantized_tensors(self) -> dict[str, torch.Tensor]:
        return {part: getattr(self, f"weight_{part}") for part in self._parts}

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The full (out, in) weight in ``dtype``."""
        # outside FSDP's forward (e.g. exporting) sharded tensors are gathered first
        tensors = {k: full_value(v) for k, v in self.quantized_tensors().items()}
        shape = (self.out_features, self.in_features)
        if self.fmt == "nf4":
            return _nf4_dequantize(tensors, shape, dtype)
        return _int8_dequantize(tensors, shape, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _DequantizedLinear.apply(x, self)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def to_linear(self, dtype: torch.dtype = torch.bfloat16) -> nn.Linear:
        """A plain ``nn.Linear`` holding the dequantized weight (frozen)."""
        w = self.dequantize(dtype)
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                           device="meta")
        linear.weight = nn.Parameter(w, requires_grad=False)
        if self.bias is not None:
            linear.bias = nn.Parameter(self.bias.detach().to(dtype), requires_grad=False)
        return linear

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"fmt={self.fmt}")


class _DequantizedLinear(torch.autograd.Function):
    """x W^T with W dequantized in forward and again in backward, so autograd never keeps
    a full-precision copy of W alive between the two (QLoRA's memory saving)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: QuantizedLinear) -> torch.Tensor:
        dtype = _compute_dtype(x)
        ctx.layer, ctx.dtype, ctx.x_dtype = layer, dtype, x.dtype
        return F.linear(x.to(dtype), layer.dequantize(dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if not ctx.needs_input_grad[0]:
            return None, None
        # Read through the module, not saved tensors: under FSDP2 the parameters are
        # all-gathered again before backward and freed after it.
        weight = ctx.layer.dequantize(ctx.dtype)
        return (grad.to(ctx.dtype) @ weight).to(ctx.x_dtype), None


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


def _is_dtensor(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch build without distributed
        return False
    return isinstance(t, DTensor)


# ------------------------------------------------------------------ whole-model API

@runtime_checkable
class HoldsQuantizableBase(Protocol):
    """A layer that keeps a base linear beside weights of its own (a LoRA layer does).
    ``quantize_base``/``dequantize_base`` below ask it to (de)quantize that base itself, so
    its own weights stay as they are. ``quantized``: the ``QuantizedLinear`` now holding
    the base (a child module of the layer), or None."""
    quantized: Optional[nn.Module]

    def quantize_base(self, fmt: str, double_quant: bool = True, device=None) -> None: ...

    def dequantize_base(self, dtype: torch.dtype = torch.bfloat16) -> None: ...


def quantize_base(model: nn.Module, fmt: str, targets: Iterable[str] | str = "all-linear",
                  double_quant: bool = True, device=None) -> list[str]:
    """Quantize the frozen base weight of every ``targets`` linear (module leaf names, or
    "all-linear" for every projection; embeddings and the output head stay as they
    are) of a materialised model. A layer holding a base of its own (LoRA:
    ``HoldsQuantizableBase``) quantizes just that base, keeping its adapters in full
    precision. Returns the names of the quantized modules.

    Run it before tensor parallelism or FSDP2 (``fully_shard``) is applied: load ->
    quantize -> shard. ``device`` quantizes layer by layer there, so a model loaded on the
    CPU (in bf16) reaches a small GPU without ever being whole on it::

        model = load_hf_model(path, device="cpu", dtype=torch.bfloat16)
        prepare_model_for_lora(model, cfg.lora)
        quantize_base(model, "nf4", device="cuda")   # codes on the GPU, one layer at a time
        model.to("cuda")                              # the rest: embeddings, norms, adapters
    """
    _check_format(fmt)
    names = resolve_targets(targets, model_projections(model))
    done = []
    for name, module in list(model.named_modules()):
        if name.rsplit(".", 1)[-1] not in names:
            continue
        if isinstance(module, HoldsQuantizableBase):
            if module.quantized is None:
                module.quantize_base(fmt, double_quant, device)
                done.append(name)
        elif type(module) is nn.Linear:
            model.set_submodule(name,
                                QuantizedLinear.from_linear(module, fmt, double_quant, device))
            done.append(name)
    if not done and not any(isinstance(m, QuantizedLinear) for m in model.modules()):
        raise QuantizationError(f"lora.targets: no linear layer named "
                                f"{', '.join(sorted(names))} to quantize")
    return done


def dequantize_base(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """Undo ``quantize_base``: every quantized layer gets a plain ``dtype`` weight again
    (the NF4/int8 rounding stays). Needed before merging adapters into the weights."""
    done, holders = [], set()
    for name, module in list(model.named_modules()):
        if name.rpartition(".")[0] in holders:
            continue  # the base inside a holder: its holder dequantized it
        if isinstance(module, HoldsQuantizableBase):
            holders.add(name)
            if module.quantized is not None:
                module.dequantize_base(dtype)
                done.append(name)
        elif isinstance(module, QuantizedLinear):
            model.set_submodule(name, module.to_linear(dtype))
            done.append(name)
    return done


def _holds_codes(module: nn.Module) -> bool:
    """A quantized linear, or another module of stored codes (``quant_experts``'s
    stacks), told by the method they share."""
    return callable(getattr(module, "quantized_tensors", None))


def is_quantized(model: nn.Module) -> bool:
    return any(_holds_codes(m) for m in model.modules())


def _check_format(fmt: str) -> None:
    if fmt not in QUANTIZE_FORMATS:
        raise QuantizationError(f"lora.quantize: {fmt!r} is not one of "
                                f"{', '.join(QUANTIZE_FORMATS)}")


def quantized_bytes(model: nn.Module) -> int:
    """Bytes held by quantized weights (codes and scales)."""
    return sum(t.numel() * t.element_size() for m in model.modules()
               if _holds_codes(m) for t in m.quantized_tensors().values())

