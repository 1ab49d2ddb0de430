"""Linear-attention layers (``BlockSpec.linear_layers``: a Gated DeltaNet in place of
attention, ``models/gated_deltanet.py``) in the performance model (docs/estimate.md,
"Hybrid linear attention"; docs/hybrid-attention.md):

- weights: the layer's five projections (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a,
  out_proj; LoRA and ``Trainability`` know them by these names) and its other parameters
  (the depthwise convolution, dt_bias, A_log, the gated norm's weight);
- activations: what the layer saves for backward is counted by running it on fake
  tensors (``FakeTensorMode``: shapes and dtypes, no data) under saved-tensor hooks, in
  the run's dtypes, with the parameters that train requiring grad. The chunked rule keeps
  a few dozen fp32 tensors per token (chunk x chunk score and decay blocks per head, q, k,
  v and their chunked copies, the solved system, one state per chunk); a walk op by op
  would restate ``delta_rule.py``, so the estimate asks the code itself. The count is
  linear in the number of chunks, so it is taken at two short lengths and extended;
- FLOPs: the projections as matmuls, and the rule itself (``forward_flops_per_token``,
  its chunk products and triangular solve, plus the convolution's taps) as the layer's
  "attention" FLOPs, backward counted as twice the forward;
- generation: a linear layer keeps no KV cache but a ``GatedDeltaNetState`` per row,
  whatever the length (``GatedDeltaNetState.bytes_per_row``).
"""
from __future__ import annotations

import contextlib
import functools

import torch

from lmforge.models.delta_rule import CHUNK_SIZE
from lmforge.models.gated_deltanet import (GatedDeltaNet, GatedDeltaNetState,
                                           forward_flops_per_token)
from lmforge.config import LoraConfig
from lmforge.models.registry import family_of
from lmforge.peft.lora import apply_lora
from lmforge.perf.tracker import TensorMemoryTracker

# The layer's projections as LoRA targets and Trainability name them, in model order.
LINEAR_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
LINEAR_INPUTS, LINEAR_OUTPUT = LINEAR_PROJECTIONS[:-1], LINEAR_PROJECTIONS[-1]


def linear_layers(args) -> tuple[int, ...]:
    """The layers whose attention is a linear-attention layer (none for most families)."""
    return tuple(family_of(args).block(args).linear_layers or ())


def is_linear(args, layer_id: int) -> bool:
    return layer_id in linear_layers(args)


def projection_shapes(args) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of a linear layer's projections."""
    key_dim = args.linear_key_heads * args.linear_key_head_dim
    value_dim = args.linear_value_heads * args.linear_value_head_dim
    heads = args.linear_value_heads
    return {"in_proj_qkv": (args.dim, 2 * key_dim + value_dim),
            "in_proj_z": (args.dim, value_dim), "in_proj_b": (args.dim, heads),
            "in_proj_a": (args.dim, heads), "out_proj": (value_dim, args.dim)}


def other_parameters(args) -> int:
    """A linear layer's parameters beside its projections: the convolution (a kernel per
    channel), dt_bias and A_log (one per value head) and the gated norm's weight."""
    channels = projection_shapes(args)["in_proj_qkv"][1]
    return (channels * args.linear_conv_kernel + 2 * args.linear_value_heads
            + args.linear_value_head_dim)


def full_attention_layers(args) -> int:
    """Layers with a KV cache (every layer but the linear ones)."""
    return args.n_layers - len(linear_layers(args))


def decode_state_bytes_per_row(args, dtype: torch.dtype) -> int:
    """What the decoder keeps per row for all the linear layers: each one's
    ``GatedDeltaNetState`` (its convolution window in ``dtype``, its fp32 state)."""
    layers = len(linear_layers(args))
    return layers and layers * GatedDeltaNetState.bytes_per_row(args, dtype)


# ---------------------------------------------------------------------------- FLOPs

def rule_flops_per_token(args, seq_len: int) -> float:
    """One linear layer's forward FLOPs per token outside its projections: the chunked
    rule's products and solve, and the convolution's taps."""
    parts = forward_flops_per_token(args, seq_len, CHUNK_SIZE)
    return parts.delta_rule + parts.conv


def add_flops(fl, args, seq_len: int, trainable, rg_in: bool, linear) -> bool:
    """Adds one layer to ``fl`` (a ``flops.FlopsBreakdown``): its projections as matmuls
    (``linear``: ``flops._linear``), the rule and the convolution as attention, backward
    twice the forward where anything before them requires grad; returns whether the
    layer's output requires grad."""
    shapes = projection_shapes(args)

    def project(name: str, needs_grad: bool) -> bool:
        return linear(fl, shapes[name], needs_grad, trainable.trains(name),
                      trainable.rank(name))

    inputs = [project(name, rg_in) for name in LINEAR_INPUTS]
    rule_needs_grad = any(inputs) or trainable.norms  # (the conv, dt_bias, A_log, norm)
    rule = rule_flops_per_token(args, seq_len)
    fl.attention_forward += rule
    if rule_needs_grad:
        fl.attention_backward += 2 * rule
    return project(LINEAR_OUTPUT, rule_needs_grad)


def matmul_params(args) -> int:
    """Every linear layer's projection weights (0 without such layers)."""
    layers = len(linear_layers(args))
    return layers and layers * sum(i * o for i, o in projection_shapes(args).values())


# ---------------------------------------------------------------------- activations

def saved_bytes_per_token(args, rows: int, seq_len: int, input_bytes: int, autocast: bool,
                          input_needs_grad: bool, trained: tuple[str, ...],
                          others_train: bool, lora: tuple = ()) -> float:
    """Bytes per token one linear layer saves for backward, its input (the norm's output,
    ``input_bytes`` per element) included when something keeps it. ``rows``: the
    micro-batch's (counted at 1 or 2: a row alone skips copies that more rows make, and
    beyond 2 the count per token stays within 0.3%, measured); ``autocast``: bf16
    autocast; ``trained``: the projections whose weight trains (or carries an adapter);
    ``others_train``: the convolution, dt_bias, A_log and norm weight."""
    return _per_token(args, min(rows, 2), seq_len, input_bytes, autocast, input_needs_grad,
                      trained, others_train, lora)[0]


def backward_bytes_per_token(args, rows: int, seq_len: int, input_bytes: int, autocast: bool,
                             input_needs_grad: bool, trained: tuple[str, ...],
                             others_train: bool, lora: tuple = ()) -> float:
    """Bytes per token the layer's backward allocates beyond what its forward saved and
    the gradient it receives, at its peak (the rule's gradients, chunk by chunk)."""
    return _per_token(args, min(rows, 2), seq_len, input_bytes, autocast, input_needs_grad,
                      trained, others_train, lora)[1]


def _per_token(args, rows: int, seq_len: int, *rest) -> tuple[float, float]:
    """(saved, backward) per token: counted on fake tensors at two lengths short of
    ``seq_len`` with its remainder modulo the chunk, and extended by the chunks between
    (both counts are linear in them)."""
    c = CHUNK_SIZE
    if seq_len <= 3 * c:
        return tuple(n / (rows * seq_len) for n in _fake_step(args, rows, seq_len, *rest))
    short = 2 * c + seq_len % c
    at_short = _fake_step(args, rows, short, *rest)
    at_longer = _fake_step(args, rows, short + c, *rest)
    return tuple((a + (seq_len - short) / c * (b - a)) / (rows * seq_len)
                 for a, b in zip(at_short, at_longer))


@functools.lru_cache(maxsize=256)
def _fake_step(args, rows: int, seq_len: int, input_bytes: int, autocast: bool,
               input_needs_grad: bool, trained: tuple[str, ...], others_train: bool,
               lora: tuple) -> tuple[int, int]:
    """One layer's forward and backward over ``rows`` rows of ``seq_len`` tokens on fake
    tensors: (bytes of the distinct storages its forward saves for backward, parameters
    left out; the most its backward allocates beyond the live bytes it starts with)."""
    from torch._subclasses.fake_tensor import FakeTensorMode  # (torch's private module)
    dtype = {4: torch.float32, 2: torch.bfloat16}[input_bytes]
    with FakeTensorMode():
        layer = GatedDeltaNet(args)
        if input_bytes == 2 and not autocast:  # (bf16 weights: the low-memory path)
            _to_bf16(layer)
        _prepare(layer, trained, others_train, lora)
        params = {p.untyped_storage()._cdata for p in layer.parameters()}
        x = torch.empty(rows, seq_len, args.dim, dtype=dtype).requires_grad_(input_needs_grad)
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage._cdata not in params:
                seen[storage._cdata] = storage.nbytes()
            return t

        cast = (torch.autocast("cpu", torch.bfloat16) if autocast
                else contextlib.nullcontext())
        tracker = TensorMemoryTracker()
        with tracker:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), cast:
                out = layer(x)
            if not out.requires_grad:  # nothing will run backward through it
                return 0, 0
            grad = torch.empty_like(out)
            start = tracker.peak = tracker.live
            out.backward(grad)
    return sum(seen.values()), tracker.peak - start


def keeps_feed_forward(args, layer_id: int) -> bool:
    """Whether ``block_backward_bytes_per_token`` runs the block's feed-forward: an MLP,
    yes; an MoE, no (fake tensors refuse the fp32 grouped product that the CPU runs), and
    its saved tensors are then taken off by the caller (its own peak is the MoE's
    buffers, counted apart)."""
    block = family_of(args).block(args)
    return block.moe is None or layer_id not in (block.sparse_layers or ())


def block_backward_bytes_per_token(args, layer_id: int, rows: int, seq_len: int,
                                   input_bytes: int, autocast: bool,
                                   trained: tuple[str, ...], others_train: bool,
                                   lora: tuple = (), input_needs_grad: bool = True
                                   ) -> tuple[float, float]:
    """Bytes per token of a linear layer's block (its feed-forward as
    ``keeps_feed_forward`` says): (its forward's peak over what it keeps at the end,
    which a checkpointed block's recompute reaches, or, with ``input_needs_grad`` False
    and nothing trained, its forward's peak alone; what its backward allocates beyond
    what the forward saved and the gradient it receives, at its peak inside the rule).
    Counted on fake tensors as ``saved_bytes_per_token`` (``others_train``: the block's
    other weights)."""
    rows, c = min(rows, 2), CHUNK_SIZE
    rest = (input_bytes, autocast, trained, others_train, lora, input_needs_grad)
    if seq_len <= 3 * c:
        return tuple(n / (rows * seq_len)
                     for n in _fake_block_step(args, layer_id, rows, seq_len, *rest))
    short = 2 * c + seq_len % c
    at_short = _fake_block_step(args, layer_id, rows, short, *rest)
    at_longer = _fake_block_step(args, layer_id, rows, short + c, *rest)
    return tuple((a + (seq_len - short) / c * (b - a)) / (rows * seq_len)
                 for a, b in zip(at_short, at_longer))


@functools.lru_cache(maxsize=256)
def _fake_block_step(args, layer_id: int, rows: int, seq_len: int, input_bytes: int,
                     autocast: bool, trained: tuple[str, ...], others_train: bool,
                     lora: tuple, input_needs_grad: bool) -> tuple[int, int]:
    """(forward's peak over its end, backward's over its start) of block ``layer_id``
    (an MoE left out), over ``rows`` x ``seq_len`` tokens on fake tensors (the
    model built fake: no memory, its layers' own code)."""
    from torch._subclasses.fake_tensor import FakeTensorMode  # (torch's private module)
    dtype = {4: torch.float32, 2: torch.bfloat16}[input_bytes]
    with FakeTensorMode():
        block = family_of(args).build(args).layers[str(layer_id)]
        if not keeps_feed_forward(args, layer_id):
            block.feed_forward = torch.nn.Identity()
        if input_bytes == 2 and not autocast:
            _to_bf16(block)
        _prepare(block, trained, others_train, lora)
        x = torch.empty(rows, seq_len, args.dim, dtype=dtype).requires_grad_(input_needs_grad)
        cast = (torch.autocast("cpu", torch.bfloat16) if autocast
                else contextlib.nullcontext())
        tracker = TensorMemoryTracker()
        with tracker:
            with cast:
                out = block(x)
            forward_excess = tracker.peak - tracker.live
            if not out.requires_grad:
                return forward_excess, 0
            grad = torch.empty_like(out)
            start = tracker.peak = tracker.live
            out.backward(grad)
    return forward_excess, tracker.peak - start


def _prepare(module: torch.nn.Module, trained: tuple[str, ...], others_train: bool,
             lora: tuple) -> None:
    """Which weights of a fake layer or block train (the projections in ``trained``, the
    rest as ``others_train`` says), with LoRA adapters swapped in (``lora_key``) and the
    frozen projections stored in bf16 where the trainer stores them so."""
    if lora:
        adapted, rank, alpha, dropout, bf16 = lora
        cfg = LoraConfig()
        cfg.rank, cfg.alpha, cfg.dropout = rank, alpha, dropout
        names = [name for name, m in module.named_modules()
                 if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in adapted]
        if names:
            apply_lora(module, cfg, names)
    for name, param in module.named_parameters():
        parts = name.split(".")
        if lora:  # (LoRA trains its adapters alone)
            param.requires_grad_("lora_a" in parts or "lora_b" in parts)
        elif len(parts) > 1 and parts[-2] in LINEAR_PROJECTIONS:
            param.requires_grad_(parts[-2] in trained)
        else:
            param.requires_grad_(others_train)
    if lora and lora[-1]:
        for m in module.modules():
            if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad:
                m.weight.data = m.weight.data.to(torch.bfloat16)


def _to_bf16(module: torch.nn.Module) -> None:
    """``module.to(torch.bfloat16)`` for fake parameters (whose ``to`` cannot swap them)."""
    for param in module.parameters():
        param.data = param.data.to(torch.bfloat16)
