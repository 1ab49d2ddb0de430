"""Decoding on the CPU with the linear layers' weights in oneDNN's packed layout.

A decoding step multiplies a few rows by every weight matrix, so on the CPU it is bound by
reading the weights. ``F.linear`` hands MKL the row-major weight as it is; the same weight
reordered once into oneDNN's blocked layout (what Inductor's ``freezing`` and IPEX do for
inference) is read much faster: on the 2-core dev machine, one pass over SmolLM2-135M's
matrices took 25 ms packed against 45 ms plain at one row, 23 ms against 70 ms at eight
(docs/benchmarks.md, "Greedy decoding").

``packed_linears`` packs each plain ``nn.Linear``'s weight for the length of one decode and
puts the plain forward back after; sibling projections of one input (q, k and v; gate and
up; a Gated DeltaNet's four input projections) are packed as one matrix, one product the siblings take their columns of. A mixture
of experts' stacked weights are packed expert by expert, and each decoding step runs only
the experts its tokens chose (``torch._grouped_mm`` on the CPU walks every expert, empty
or not: 1.4x slower per MoE layer at one token, 64 experts, top-8). The packed copy is a snapshot: nothing may change the
weights while it lives, and nothing does (decoding runs under ``no_grad``; a training step
comes between two rollouts, never during one). Only exact ``nn.Linear`` modules are packed
(LoRA's and the quantized layers' forwards do more than a product), with fp32 weights on the
CPU that are not sharded (a DTensor's local shard is not the whole matrix), in a model no
part of which is compiled (the compiler cannot trace a packed tensor); the copy
doubles those weights' memory while it lives, so it is skipped when ``budget`` bytes cannot
hold it. Anything not packed decodes exactly as before. The packed product sums in another
order than MKL's: results differ from the plain forward's in the last bits (about 1e-6
relative), as any change of kernel or batch shape makes them.

The weights are packed in the dtype the products compute in: under CPU autocast (a bf16 or
fp16 run's end-of-run sample, eval and GRPO rollouts) autocast's dtype, which is what
``F.linear`` would cast the weight and input to, else fp32. oneDNN packs bf16 on any
AVX-512 or AVX2 CPU, fp16 only on CPUs with AVX512-FP16 or AVX-NE-CONVERT: a dtype this CPU
cannot pack leaves every layer plain. A packed layer called in another dtype than the one
it was packed for (autocast entered or left inside the block) runs its plain forward.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lmforge.models.moe import GroupedExperts


def packable(module: nn.Module) -> bool:
    """A plain linear layer whose fp32 CPU weight is whole (not sharded), not yet packed."""
    if type(module) is not nn.Linear or "forward" in module.__dict__:
        return False
    w = module.weight
    return (not isinstance(w, DTensor) and w.device.type == "cpu"
            and w.dtype == torch.float32)


def packable_experts(module: nn.Module) -> bool:
    """Plain grouped experts (not LoRA's or quantized ones, whose weights are made per
    forward) with whole fp32 CPU stacks, not yet packed."""
    if type(module) is not GroupedExperts or "product" in module.__dict__:
        return False
    w = module.gate_up_proj
    return (not isinstance(w, DTensor) and w.device.type == "cpu"
            and w.dtype == torch.float32)


def _pack_experts(experts: GroupedExperts, rows: int, dtype: torch.dtype) -> None:
    """Each expert's weights packed alone, when first chosen (a short decode reads few
    of them); the experts' ``product`` runs the chosen experts one packed product each
    (rows sorted by expert, as ``grouped_linear``)."""
    packed: dict = {}

    def weight(name: str, e: int) -> torch.Tensor:
        if (name, e) not in packed:
            w = getattr(experts, name).detach()[e].to(dtype)
            packed[name, e] = torch.ops.mkldnn._reorder_linear_weight(w, max(rows, 1))
        return packed[name, e]

    def product(name: str, x: torch.Tensor, counts: torch.Tensor,
                chosen: torch.Tensor) -> torch.Tensor:
        if compute_dtype(x.dtype) != dtype:  # (autocast entered or left since packing)
            return GroupedExperts.product(experts, name, x, counts, chosen)
        out = x.new_empty(x.shape[0], getattr(experts, name).shape[1], dtype=dtype)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n:
                out[start:start + n] = _product(x[start:start + n], weight(name, e), None)
                start += n
        return out  # (rows, out)
    product.packed = packed  # (name, expert) -> its packed weight: those chosen so far
    experts.product = product


# sibling projections that read the same input: packed as one product (one larger matrix
# is read faster than two or three smaller ones, and it is one call instead of several)
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"),
            # a Gated DeltaNet's input projections (models/gated_deltanet.py)
            ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"))


@contextlib.contextmanager
def packed_linears(model: nn.Module, rows: int, budget: int) -> Iterator[int]:
    """Pack ``model``'s packable linear layers for products of about ``rows`` rows (oneDNN's
    hint; any number of rows stays correct) in the dtype they compute in now
    (``compute_dtype``) while the block runs; yields how many were packed (0: none could
    be, their copies would not fit in ``budget`` bytes, or this CPU cannot pack that
    dtype)."""
    groups = [] if compiled(model) else _products(model)
    stacks = [] if compiled(model) else [m for m in model.modules() if packable_experts(m)]
    modules = [m for g in groups for m in g]
    dtype = compute_dtype()
    size = (sum(m.weight.numel() for m in modules)
            + sum(m.gate_up_proj.numel() + m.down_proj.numel() for m in stacks))
    if not groups + stacks or 2 * size * dtype.itemsize > budget or not available(dtype):
        yield 0
        return
    try:
        for group in groups:
            _pack(group, rows, dtype)
        for experts in stacks:
            _pack_experts(experts, rows, dtype)
        yield len(modules) + len(stacks)
    finally:
        for m in modules:
            m.__dict__.pop("forward", None)
        for m in stacks:
            m.__dict__.pop("product", None)


def compute_dtype(weight_dtype: torch.dtype = torch.float32) -> torch.dtype:
    """The dtype a CPU linear layer with ``weight_dtype`` weights computes in here: CPU
    autocast's when it is on (``F.linear`` casts its input and weight to it), else the
    weight's."""
    if torch.is_autocast_enabled("cpu"):
        return torch.get_autocast_dtype("cpu")
    return weight_dtype


def compiled(model: nn.Module) -> bool:
    """Whether ``torch.compile`` runs any part of ``model`` (``train.compile`` compiles each
    block): a compiled module traces its layers' forwards, and cannot trace a packed one."""
    return any(getattr(m, "_compiled_call_impl", None) is not None
               or isinstance(m, torch._dynamo.eval_frame.OptimizedModule)
               for m in model.modules())


def _products(model: nn.Module) -> list[list[nn.Linear]]:
    """The products to pack: each set of packable ``SIBLINGS`` of one module as one, every
    other packable linear layer alone."""
    groups, grouped = [], set()
    for parent in model.modules():
        for names in SIBLINGS:
            kids = [getattr(parent, name, None) for name in names]
            if all(packable(k) for k in kids) and len({k.in_features for k in kids}) == 1:
                groups.append(kids)
                grouped.update(id(k) for k in kids)
    return groups + [[m] for m in model.modules() if packable(m) and id(m) not in grouped]


def _pack(group: list[nn.Linear], rows: int, dtype: torch.dtype) -> None:
    """Give each layer of ``group`` a forward over one packed product of all of them,
    computed in ``dtype`` (the weights and biases cast to it, as autocast casts them)."""
    weight = torch.cat([m.weight.detach() for m in group]) if len(group) > 1 \
        else group[0].weight.detach()
    bias = None
    if any(m.bias is not None for m in group):
        bias = torch.cat([m.bias.detach() if m.bias is not None
                          else m.weight.new_zeros(m.out_features) for m in group]).to(dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(dtype), max(rows, 1))
    if len(group) == 1:
        layer = group[0]
        layer.forward = lambda x: (_product(x, packed, bias) if _fits(x, packed)
                                   else nn.Linear.forward(layer, x))
        return
    shared = _SharedProduct(packed, bias, len(group))
    edges = [0]
    for m in group:
        edges.append(edges[-1] + m.out_features)
    for i, (m, lo, hi) in enumerate(zip(group, edges, edges[1:])):
        m.forward = shared.part(i, lo, hi, m)


class _SharedProduct:
    """One packed product of sibling layers: the first sibling called with an input makes
    the whole product, and a sibling called with that very tensor takes its columns of it
    (a view). An input that is not the last one held (``is``, and the last one is held, so
    its identity cannot be reused) makes a new product: correct whatever the call order.
    Once every sibling has taken its columns the product is let go, so no layer holds its
    last product (a prefill's is rows x prompt x the siblings' widths) past its use."""

    def __init__(self, packed: torch.Tensor, bias, siblings: int):
        self.packed, self.bias, self.siblings = packed, bias, siblings
        self.input, self.output, self.taken = None, None, set()

    def part(self, i: int, lo: int, hi: int, layer: nn.Linear):
        def forward(x: torch.Tensor) -> torch.Tensor:
            if not _fits(x, self.packed):
                return nn.Linear.forward(layer, x)
            if x is not self.input:
                self.input, self.output = x, _product(x, self.packed, self.bias)
                self.taken = set()
            out = self.output[..., lo:hi]
            self.taken.add(i)
            if len(self.taken) == self.siblings:
                self.input, self.output = None, None
            return out
        return forward


def _fits(x: torch.Tensor, packed: torch.Tensor) -> bool:
    """Whether the plain forward would compute this call in the packed weight's dtype."""
    return compute_dtype(x.dtype) == packed.dtype


def _product(x: torch.Tensor, packed: torch.Tensor, bias) -> torch.Tensor:
    """The packed product in the packed weight's dtype (``_fits``: an fp32 input under
    autocast is cast to it, as ``F.linear`` would cast it)."""
    return torch.ops.mkldnn._linear_pointwise(x.to(packed.dtype), packed, bias, "none", [],
                                               "")


@functools.cache
def available(dtype: torch.dtype = torch.float32) -> bool:
    """oneDNN is built in and packs ``dtype`` on this CPU (checked once per dtype, on a
    tiny matrix)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        ones = torch.ones(4, 4, dtype=dtype)
        return bool((_product(ones[:1], torch.ops.mkldnn._reorder_linear_weight(ones, 1),
                              None) == 4).all())
    except (RuntimeError, AttributeError):
        return False
