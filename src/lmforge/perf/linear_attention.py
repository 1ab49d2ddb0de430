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
- tensor parallelism (``models.tp.linear_attention_plan``): each rank holds whole key
  heads with their value heads, so its projections, convolution, dt_bias and A_log are
  1 / tp of the layer's (the gated norm's weight whole), its fake runs are of
  ``rank_args`` (1 / tp of the heads and of the MLP's width, the input whole: every
  rank reads the whole sequence, gathered under sequence parallelism), and so is its
  decoding state;
- FLOPs: the projections as matmuls, and the rule itself (``forward_flops_per_token``,
  its chunk products and triangular solve, plus the convolution's taps) as the layer's
  "attention" FLOPs, backward counted as twice the forward;
- generation: a linear layer keeps no KV cache but a ``GatedDeltaNetState`` per row,
  whatever the length (``GatedDeltaNetState.bytes_per_row``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch

from lmforge.models.delta_rule import CHUNK_SIZE
from lmforge.models.gated_deltanet import (INPUT_PROJECTIONS, OUTPUT_PROJECTION,
                                           GatedDeltaNet, GatedDeltaNetState,
                                           forward_flops_per_token)
from lmforge.config import LoraConfig
from lmforge.models.registry import family_of
from lmforge.peft.lora import apply_lora
from lmforge.perf.tracker import TensorMemoryTracker

# The layer's projections as LoRA targets and Trainability name them, in model order.
LINEAR_INPUTS, LINEAR_OUTPUT = INPUT_PROJECTIONS, OUTPUT_PROJECTION
LINEAR_PROJECTIONS = (*LINEAR_INPUTS, LINEAR_OUTPUT)


def linear_layers(args) -> tuple[int, ...]:
    """The layers whose attention is a linear-attention layer (none for most families)."""
    return tuple(family_of(args).block(args).linear_layers or ())


def is_linear(args, layer_id: int) -> bool:
    return layer_id in linear_layers(args)


def projection_shapes(args) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of a linear layer's projections, as the family's block
    spec gives them (``BlockSpec.linear_attention_shapes``)."""
    return dict(family_of(args).block(args).linear_attention_shapes)


def other_parameters(args, tp: int = 1) -> int:
    """A linear layer's parameters beside its projections on one of ``tp`` ranks: the
    convolution (a kernel per channel), dt_bias and A_log (one per value head), split
    with the heads, and the gated norm's weight (one for every head: replicated)."""
    channels = projection_shapes(args)["in_proj_qkv"][1]
    return ((channels * args.linear_conv_kernel + 2 * args.linear_value_heads) // tp
            + args.linear_value_head_dim)


def rank_args(args, tp: int):
    """``args`` as one of ``tp`` tensor-parallel ranks runs a linear-attention block: 1 /
    tp of the key heads, each with its value heads, and of the MLP's width (column- then
    row-parallel); the model's width whole. Without ``vision_from`` (where an image-text
    model came from, a path): the fake runs are cached on these args, whatever the
    directory."""
    return dataclasses.replace(args, linear_key_heads=args.linear_key_heads // tp,
                               linear_value_heads=args.linear_value_heads // tp,
                               ffn_dim=args.ffn_dim // tp, vision_from=None)


def full_attention_layers(args) -> int:
    """Layers with a KV cache (every layer but the linear ones)."""
    return args.n_layers - len(linear_layers(args))


def decode_state_bytes_per_row(args, dtype: torch.dtype, tp: int = 1) -> int:
    """What the decoder keeps per row for all the linear layers on one of ``tp`` ranks:
    each one's ``GatedDeltaNetState`` of this rank's heads (its convolution window in
    ``dtype``, its fp32 state)."""
    layers = len(linear_layers(args))
    return layers and layers * GatedDeltaNetState.bytes_per_row(rank_args(args, tp), dtype)


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

def saved_bytes_per_token(args, tp: int, rows: int, seq_len: int, input_bytes: int,
                          autocast: bool, input_needs_grad: bool, trained: tuple[str, ...],
                          others_train: bool, lora: tuple = ()) -> float:
    """Bytes per token one linear layer saves for backward on one of ``tp`` ranks, its
    input (the norm's output, ``input_bytes`` per element, the whole sequence) included
    when something keeps it. ``rows``: the micro-batch's (counted at 1 or 2: a row alone
    skips copies that more rows make, and beyond 2 the count per token stays within
    0.3%, measured); ``autocast``: bf16 autocast; ``trained``: the projections whose
    weight trains (or carries an adapter); ``others_train``: the convolution, dt_bias,
    A_log and norm weight."""
    args, rows = rank_args(args, tp), min(rows, 2)
    rest = (input_bytes, autocast, input_needs_grad, trained, others_train, lora)
    return _extended(lambda length: (_fake_saved(args, rows, length, *rest),), seq_len,
                     rows)[0]


def _extended(count, seq_len: int, rows: int) -> tuple[float, ...]:
    """Per token, the counts ``count(length)`` makes of ``rows`` rows: at ``seq_len``
    itself when short, else at two lengths short of it with its remainder modulo the
    chunk, extended by the chunks between (every count is linear in them)."""
    c = CHUNK_SIZE
    if seq_len <= 3 * c:
        return tuple(n / (rows * seq_len) for n in count(seq_len))
    short = 2 * c + seq_len % c
    at_short, at_longer = count(short), count(short + c)
    return tuple((a + (seq_len - short) / c * (b - a)) / (rows * seq_len)
                 for a, b in zip(at_short, at_longer))


def _input(rows: int, seq_len: int, args, dtype: torch.dtype,
           needs_grad: bool) -> torch.Tensor:
    """A fake layer's or block's input: an op's output, as in the model, not a leaf
    (autocast caches its bf16 copy of a leaf that requires grad, as it does a weight's,
    and the projections would share one copy where the model makes one each)."""
    return torch.empty(rows, seq_len, args.dim, dtype=dtype).requires_grad_(needs_grad) * 1


@functools.lru_cache(maxsize=256)
def _fake_saved(args, rows: int, seq_len: int, input_bytes: int, autocast: bool,
                input_needs_grad: bool, trained: tuple[str, ...], others_train: bool,
                lora: tuple) -> int:
    """Bytes of the distinct storages one layer's forward over ``rows`` rows of
    ``seq_len`` tokens saves for backward (parameters left out), on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode  # (torch's private module)
    dtype = {4: torch.float32, 2: torch.bfloat16}[input_bytes]
    with FakeTensorMode():
        layer = GatedDeltaNet(args)
        if input_bytes == 2 and not autocast:  # (bf16 weights: the low-memory path)
            _to_bf16(layer)
        _prepare(layer, trained, others_train, lora)
        params = {p.untyped_storage()._cdata for p in layer.parameters()}
        x = _input(rows, seq_len, args, dtype, input_needs_grad)
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage._cdata not in params:
                seen[storage._cdata] = storage.nbytes()
            return t

        cast = (torch.autocast("cpu", torch.bfloat16) if autocast
                else contextlib.nullcontext())
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), cast:
            out = layer(x)
    return sum(seen.values()) if out.requires_grad else 0


def keeps_feed_forward(args, layer_id: int) -> bool:
    """Whether ``block_backward_bytes_per_token`` runs the block's feed-forward: an MLP,
    yes; an MoE, no (fake tensors refuse the fp32 grouped product that the CPU runs), and
    its saved tensors are then taken off by the caller (its own peak is the MoE's
    buffers, counted apart)."""
    block = family_of(args).block(args)
    return block.moe is None or layer_id not in (block.sparse_layers or ())


def block_backward_bytes_per_token(args, tp: int, layer_id: int, rows: int, seq_len: int,
                                   input_bytes: int, autocast: bool,
                                   trained: tuple[str, ...], others_train: bool,
                                   lora: tuple = (), input_needs_grad: bool = True
                                   ) -> tuple[float, float]:
    """Bytes per token of a linear layer's block on one of ``tp`` ranks (its
    feed-forward as ``keeps_feed_forward`` says): (the most its forward holds beyond
    what it saves for backward, which a checkpointed block's recompute reaches, its
    output not being kept; with ``input_needs_grad`` False and nothing trained, the
    most its forward holds; what its backward allocates beyond what the forward saved
    and the gradient it receives, at its peak inside the rule). Counted on fake tensors
    as ``saved_bytes_per_token`` (``others_train``: the block's other weights), over the
    whole sequence and width (under sequence parallelism the block's norms run on 1 /
    tp of the tokens: a little over)."""
    args, rows = rank_args(args, tp), min(rows, 2)
    rest = (input_bytes, autocast, trained, others_train, lora, input_needs_grad)
    return _extended(lambda length: _fake_block_step(args, layer_id, rows, length, *rest),
                     seq_len, rows)


@functools.lru_cache(maxsize=256)
def _fake_block_step(args, layer_id: int, rows: int, seq_len: int, input_bytes: int,
                     autocast: bool, trained: tuple[str, ...], others_train: bool,
                     lora: tuple, input_needs_grad: bool) -> tuple[int, int]:
    """(forward's peak over what it saves, backward's over its start) of block
    ``layer_id`` (an MoE left out), over ``rows`` x ``seq_len`` tokens on fake tensors
    (the model built fake: no memory, its layers' own code)."""
    from torch._subclasses.fake_tensor import FakeTensorMode  # (torch's private module)
    dtype = {4: torch.float32, 2: torch.bfloat16}[input_bytes]
    with FakeTensorMode():
        block = family_of(args).build(args).layers[str(layer_id)]
        if not keeps_feed_forward(args, layer_id):
            block.feed_forward = torch.nn.Identity()
        if input_bytes == 2 and not autocast:
            _to_bf16(block)
        _prepare(block, trained, others_train, lora)
        x = _input(rows, seq_len, args, dtype, input_needs_grad)
        cast = (torch.autocast("cpu", torch.bfloat16) if autocast
                else contextlib.nullcontext())
        tracker = TensorMemoryTracker()
        with tracker:
            with cast:
                out = block(x)
            saved = tracker.live - out.untyped_storage().nbytes()
            forward_excess = tracker.peak - saved
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
