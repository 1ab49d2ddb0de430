"""Gated DeltaNet (Yang, Kautz and Hatamizadeh, "Gated Delta Networks", 2024), the linear
attention layer of Qwen3-Next, Qwen3.5 and Qwen3.5-MoE.

Each value head keeps a state S (key dim x value dim), a fast-weight memory that maps keys
to values. At each token it first decays, S <- exp(g) S, then moves its prediction for
the token's key toward the token's value by a step beta (the delta rule):

    S <- S + beta k (v - S^T k)^T,        output o = S^T q / sqrt(key dim)

g = -exp(A_log) softplus(a + dt_bias) <= 0 (Mamba-2's decay) and beta = sigmoid(b) come
from the token. Before that, q, k and v pass through a short causal depthwise convolution
with SiLU, and q and k are L2-normalised (so S^T k stays bounded). The output is
normalised per head and gated, norm(o) * silu(z), and projected back.

The rule itself, chunked (training, prefill) or a token at a time (decoding), is
``models/delta_rule.py``.

A packed row (a ``DocumentMask``'s segments) restarts both the state and the convolution
window at each document's first token, so a document sees nothing of the one before it.
Decoding keeps a ``GatedDeltaNetState`` per layer (the convolution's last inputs and S);
left-padded rows (a ``DecodeMask``, or ``valid``) leave padding out of both.

Parameters are Qwen3.5's (transformers' ``Qwen3_5GatedDeltaNet``, the same leaf names):
in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, conv1d, dt_bias, A_log, norm, out_proj. In
memory in_proj_qkv's rows, and conv1d's channels that follow them, are grouped per key
head (``qkv_layout``: its q, its k, its value heads' v), so a tensor-parallel shard of
whole key heads holds matching rows of all three; the checkpoints' order (every q, then
every k, then every v) is restored on export (``models.hf``). Qwen3-Next's checkpoints
fuse the input projections per key head (in_proj_qkvz, in_proj_ba); ``from_qwen3_next``
and ``to_qwen3_next`` convert, rows reordered only (both in the checkpoints' order).

Under tensor parallelism (``models.tp.linear_attention_plan``) each rank holds whole key
heads with their value heads: its rows of the input projections, its channels of the
convolution, its heads' dt_bias and A_log (read here as this rank's tensors, ``_local``)
and its share of out_proj's inputs; its state holds its heads only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from lmforge.models.attention import ContextParallel, DecodeMask, DocumentMask
from lmforge.models.delta_rule import CHUNK_SIZE, document_index, rules
from lmforge.models.family import Fused
from lmforge.models.llama.model import RMSNorm

# The layer's linear layers by name (Qwen3.5's): the inputs' and the output's.
INPUT_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
OUTPUT_PROJECTION = "out_proj"

# FLA's (and transformers') L2 norm: x / sqrt(sum x^2 + eps), in fp32.
L2_NORM_EPS = 1e-6


@dataclass(frozen=True)
class GatedDeltaNetArgs:
    """What ``GatedDeltaNet`` reads (any object with these attribute names will do: a
    hybrid family's args carry them beside its attention's). Defaults: Qwen3-Next-80B's."""
    dim: int
    linear_key_heads: int = 16
    linear_value_heads: int = 32  # a multiple of the key heads: each key head serves a group
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel: int = 4
    norm_eps: float = 1e-6


def _sizes(args) -> tuple[int, int, int]:
    """(key dim, value dim, conv channels): q and k each take the key dim."""
    key_dim = args.linear_key_heads * args.linear_key_head_dim
    value_dim = args.linear_value_heads * args.linear_value_head_dim
    return key_dim, value_dim, 2 * key_dim + value_dim


def qkv_layout(args) -> Fused:
    """in_proj_qkv's rows (and conv1d's channels) in memory: one group per key head, its
    q, its k, then the v of the value heads it serves (Qwen3-Next's order within
    in_proj_qkvz, less z)."""
    key_dim, value_dim, _ = _sizes(args)
    return Fused(parts=(("q", key_dim), ("k", key_dim), ("v", value_dim)),
                 groups=args.linear_key_heads)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter tensor parallelism split (itself otherwise)."""
    return t.to_local() if isinstance(t, DTensor) else t


# ------------------------------------------------------------------------ the layer

@dataclass
class GatedDeltaNetState:
    """One layer's decoding state, advanced in place (so a compiled step may hold it):
    the convolution's last kernel - 1 inputs, and each value head's S."""
    conv: torch.Tensor  # (batch, kernel - 1, conv channels), the activations' dtype
    recurrent: torch.Tensor  # (batch, value heads, key head dim, value head dim), fp32

    @classmethod
    def empty(cls, args, batch: int, device=None, dtype=torch.float32, shards: int = 1
              ) -> "GatedDeltaNetState":
        """A fresh state: zeros, which is what no past at all means to both parts;
        ``shards``: a tensor-parallel rank's, of its 1 / shards of the heads."""
        channels = _sizes(args)[2] // shards
        return cls(torch.zeros(batch, args.linear_conv_kernel - 1, channels, device=device,
                               dtype=dtype),
                   torch.zeros(batch, args.linear_value_heads // shards,
                               args.linear_key_head_dim, args.linear_value_head_dim,
                               device=device))

    def buffers(self) -> tuple[torch.Tensor, ...]:
        """What a compiled decode step reads and writes in place (static addresses)."""
        return self.conv, self.recurrent

    @staticmethod
    def bytes_per_row(args, dtype: torch.dtype) -> int:
        """One row's state, whatever the sequence's length (the KV cache's counterpart)."""
        return ((args.linear_conv_kernel - 1) * _sizes(args)[2] * dtype.itemsize
                + args.linear_value_heads * args.linear_key_head_dim
                * args.linear_value_head_dim * 4)


class CausalConv1d(nn.Module):
    """Depthwise causal convolution over the sequence, channels last: channel c at t is
    sum_j weight[c, 0, j] x[t - (kernel - 1) + j, c]. The weight keeps ``nn.Conv1d``'s
    (and the checkpoints') shape. Written as kernel shifted products rather than
    ``F.conv1d`` so that a tap from another document can be dropped; summed in fp32, as
    the fused kernels (causal-conv1d) and torch's bf16 convolution do, so a bf16 layer
    rounds as transformers' does."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))

    def forward(self, x: torch.Tensor, history: Optional[torch.Tensor] = None,
                documents: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x (batch, seq, channels); ``history`` (batch, kernel - 1, channels): the inputs
        just before x (None: zeros, a sequence's start); ``documents`` (batch, seq)
        (``document_index``): no tap reaches into an earlier document."""
        batch, seq, channels = x.shape
        kernel = self.weight.shape[-1]
        if history is None:
            history = x.new_zeros(batch, kernel - 1, channels)
        inputs = torch.cat([history.to(x.dtype), x], 1).float()  # (b, kernel - 1 + seq, ch)
        weight = _local(self.weight)[:, 0].float()  # (channels, kernel)
        if seq == 1:  # a decode step: its one window in one product (not kernel of them)
            return (inputs * weight.T).sum(1, keepdim=True).to(x.dtype)
        out = inputs[:, kernel - 1:] * weight[:, -1]
        for shift in range(1, kernel):
            past = inputs[:, kernel - 1 - shift:kernel - 1 - shift + seq]  # x[t - shift]
            if documents is not None:  # (before the row's start: history, zeros here)
                same = documents == F.pad(documents, (shift, 0), value=-1)[:, :seq]
                past = past * same[..., None]
            out = out + past * weight[:, kernel - 1 - shift]
        return out.to(x.dtype)  # (batch, seq, channels)


class GatedRMSNorm(RMSNorm):
    """norm(x) * silu(gate): the RMS norm first, then the gate (Qwen3-Next's
    RMSNormGated), over each head's values."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return (super().forward(x) * F.silu(gate.float())).to(x.dtype)


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + L2_NORM_EPS)


class GatedDeltaNet(nn.Module):
    """The Gated DeltaNet layer; a block calls it as it calls attention:
    ``forward(x, positions, mask, cache)``."""
    # Into how many parts tensor parallelism split the heads (``models.tp``): this rank
    # holds 1 / head_shards of them, and so does its decoding state.
    head_shards = 1

    def __init__(self, args, chunk_size: int = CHUNK_SIZE):
        super().__init__()
        self.args, self.chunk_size = args, chunk_size
        if args.linear_value_heads % args.linear_key_heads:
            raise ValueError(f"linear_value_heads ({args.linear_value_heads}) is not a "
                             f"multiple of linear_key_heads ({args.linear_key_heads})")
        key_dim, value_dim, channels = _sizes(args)
        heads = args.linear_value_heads
        self.in_proj_qkv = nn.Linear(args.dim, channels, bias=False)
        self.in_proj_z = nn.Linear(args.dim, value_dim, bias=False)
        self.in_proj_b = nn.Linear(args.dim, heads, bias=False)
        self.in_proj_a = nn.Linear(args.dim, heads, bias=False)
        self.conv1d = CausalConv1d(channels, args.linear_conv_kernel)
        self.dt_bias = nn.Parameter(torch.empty(heads))
        self.A_log = nn.Parameter(torch.empty(heads))
        self.norm = GatedRMSNorm(args.linear_value_head_dim, args.norm_eps)
        self.out_proj = nn.Linear(value_dim, args.dim, bias=False)

    def forward(self, x, positions=None, mask=None,
                cache: Optional[GatedDeltaNetState] = None) -> torch.Tensor:
        """x (batch, seq, dim). ``positions``: unused (order comes from the recurrence).
        ``mask``: None, a packed batch's ``DocumentMask``, or the decoder's ``DecodeMask``
        (its left padding left out of the state). ``cache``: read, then advanced."""
        if isinstance(mask, DocumentMask):
            return self.mix(x, cache, segments=mask.segments)
        if isinstance(mask, DecodeMask):
            return self.mix(x, cache, valid=mask.memo("valid", mask.valid), real=mask.real)
        if isinstance(mask, ContextParallel):
            raise ValueError("parallel.cp: a Gated DeltaNet layer has no context "
                             "parallelism (its state runs through the whole sequence)")
        if mask is not None:
            raise ValueError("a Gated DeltaNet layer takes a DocumentMask or a DecodeMask, "
                             "not an explicit attention mask")
        return self.mix(x, cache)

    def prefill(self, x: torch.Tensor, valid: Optional[torch.Tensor] = None
                ) -> tuple[torch.Tensor, GatedDeltaNetState]:
        """The output over a prompt and the state after it. ``valid`` (batch, seq) bool:
        False at (left) padding, which leaves the state as it found it."""
        state = self.new_cache(x.shape[0], x.shape[1], x.device, x.dtype)
        return self.mix(x, state, valid=valid), state

    def new_cache(self, batch: int, max_len: int, device, dtype) -> GatedDeltaNetState:
        """The decoder's cache for this layer (``models.common.new_caches``): its state
        (this rank's heads'), whatever ``max_len``."""
        return GatedDeltaNetState.empty(self.args, batch, device, dtype, self.head_shards)

    def step(self, x: torch.Tensor, state: GatedDeltaNetState) -> torch.Tensor:
        """The output of the next token(s) x (batch, seq, dim); advances ``state``."""
        return self.mix(x, state)

    def mix(self, x: torch.Tensor, state: Optional[GatedDeltaNetState] = None, *,
            segments: Optional[torch.Tensor] = None,
            valid: Optional[torch.Tensor] = None, real: Optional[int] = None
            ) -> torch.Tensor:
        """The layer: x (batch, seq, dim) -> (batch, seq, dim), reading and advancing
        ``state`` if any; ``segments`` (batch, seq) a packed row's documents; ``valid``
        (batch, seq) bool, False where a position is padding; ``real``: only the first
        ``real`` positions are tokens, the rest fillers (a sequence-parallel decode
        step's), left out of the state."""
        args = self.args
        batch, seq, _ = x.shape
        if segments is not None and state is not None:
            raise ValueError("a packed batch's documents are for training, not decoding")
        documents = document_index(segments) if segments is not None else None
        qkv = self.in_proj_qkv(x)  # (batch, seq, channels), grouped per key head
        if valid is not None:  # padding's inputs are zeros: the window sees a fresh start
            qkv = qkv * valid[..., None].to(qkv.dtype)
        mixed = F.silu(self.conv1d(qkv, state.conv if state is not None else None, documents))
        if state is not None:  # the window's last inputs: the last real ones
            tokens = seq if real is None else real
            window = torch.cat([state.conv, qkv.to(state.conv.dtype)], 1)
            state.conv.copy_(window[:, tokens:tokens + state.conv.shape[1]])
        dk, dv = args.linear_key_head_dim, args.linear_value_head_dim
        group = args.linear_value_heads // args.linear_key_heads
        # Per key head (``qkv_layout``) its q, its k, and the v of the ``group``
        # consecutive value heads it serves.
        qk, v = mixed.view(batch, seq, -1, 2 * dk + group * dv).split([2 * dk, group * dv], -1)
        # q and k normalised and repeated together (half the ops of a decode step's pair)
        qk = l2_normalize(qk.unflatten(-1, (2, dk))).repeat_interleave(group, 2)
        q, k = qk.unbind(3)  # (batch, seq, value heads, key head dim) each
        v = v.reshape(batch, seq, -1, dv)  # (batch, seq, value heads, value head dim)
        beta = self.in_proj_b(x).float().sigmoid()  # (batch, seq, heads)
        # In fp32 whatever the weights' dtype: g's rounding compounds over every token.
        g = -_local(self.A_log).float().exp() * F.softplus(
            self.in_proj_a(x).float() + _local(self.dt_bias).float())
        if valid is not None:  # padding neither decays the state nor writes to it
            beta, g = beta * valid[..., None], g * valid[..., None]
        initial = state.recurrent if state is not None else None
        chunk_rule, recurrent_rule = rules(x.device)  # (FLA's kernels on a GPU, if present)
        if state is not None and seq == 1:  # (decoding: the state advanced in place)
            out, final = recurrent_rule(q, k, v, g, beta, initial_state=initial,
                                        inplace=not torch.is_grad_enabled())
        else:
            out, final = chunk_rule(q, k, v, g, beta, chunk_size=self.chunk_size,
                                    initial_state=initial, segments=segments)
        if state is not None and final is not state.recurrent:
            state.recurrent.copy_(final)
        z = self.in_proj_z(x).view(batch, seq, -1, args.linear_value_head_dim)
        out = self.norm(out, z)  # (batch, seq, value heads, value head dim)
        return self.out_proj(out.reshape(batch, seq, -1))

    @torch.no_grad()
    def reset_parameters(self, std: float, out_std: float) -> None:
        """As transformers initialises a Qwen3-Next layer: the projections and the
        convolution truncated N(0, std), the output (which adds to the residual)
        ``out_std``; dt_bias ones; A = exp(A_log) uniform in [0.01, 16], so heads start
        with decays from slow to fast; the norm identity."""
        for weight, s in ((self.in_proj_qkv.weight, std), (self.in_proj_z.weight, std),
                          (self.in_proj_b.weight, std), (self.in_proj_a.weight, std),
                          (self.conv1d.weight, std), (self.out_proj.weight, out_std)):
            nn.init.trunc_normal_(weight, std=s, a=-3 * s, b=3 * s)
        nn.init.ones_(self.dt_bias)
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0.01, 16).log())
        self.norm.reset_parameters()


# ------------------------------------------------------------------ checkpoints

def _qwen3_next_groups(args) -> tuple[int, list[int], list[int]]:
    """Qwen3-Next fuses per key head: in_proj_qkvz's rows are, for each key head in turn,
    its q, its k, then the v and the z of its group of value heads; in_proj_ba's, the b
    then the a of its group. (key heads, qkvz split, ba split)."""
    group = args.linear_value_heads // args.linear_key_heads
    dk, dv = args.linear_key_head_dim, args.linear_value_head_dim
    return args.linear_key_heads, [dk, dk, group * dv, group * dv], [group, group]


def from_qwen3_next(state_dict: dict, args) -> dict:
    """A state dict with Qwen3-Next's fused ``in_proj_qkvz`` and ``in_proj_ba`` (any
    prefix) -> ours (Qwen3.5's names): rows regrouped, nothing else changed."""
    heads, qkvz_split, ba_split = _qwen3_next_groups(args)
    out = {}
    for name, tensor in state_dict.items():
        dim = tensor.shape[-1] if tensor.dim() else 0
        if name.endswith("in_proj_qkvz.weight"):
            prefix = name.removesuffix("qkvz.weight")
            q, k, v, z = (p.reshape(-1, dim)
                          for p in tensor.view(heads, -1, dim).split(qkvz_split, 1))
            out[prefix + "qkv.weight"], out[prefix + "z.weight"] = torch.cat([q, k, v]), z
        elif name.endswith("in_proj_ba.weight"):
            prefix = name.removesuffix("ba.weight")
            b, a = (p.reshape(-1, dim) for p in tensor.view(heads, -1, dim).split(ba_split, 1))
            out[prefix + "b.weight"], out[prefix + "a.weight"] = b, a
        else:
            out[name] = tensor
    return out


def to_qwen3_next(state_dict: dict, args) -> dict:
    """Ours -> Qwen3-Next's fused projections: ``from_qwen3_next``'s inverse."""
    heads = args.linear_key_heads
    key_dim, value_dim, _ = _sizes(args)
    out = {}
    for name, tensor in state_dict.items():
        dim = tensor.shape[-1] if tensor.dim() else 0
        if name.endswith("in_proj_qkv.weight"):
            prefix = name.removesuffix("qkv.weight")
            q, k, v = tensor.split([key_dim, key_dim, value_dim])
            parts = (q, k, v, state_dict[prefix + "z.weight"])
            out[prefix + "qkvz.weight"] = torch.cat(
                [p.reshape(heads, -1, dim) for p in parts], 1).reshape(-1, dim)
        elif name.endswith("in_proj_b.weight"):
            prefix = name.removesuffix("b.weight")
            parts = (tensor, state_dict[prefix + "a.weight"])
            out[prefix + "ba.weight"] = torch.cat(
                [p.reshape(heads, -1, dim) for p in parts], 1).reshape(-1, dim)
        elif not name.endswith(("in_proj_z.weight", "in_proj_a.weight")):
            out[name] = tensor
    return out


# ------------------------------------------------------------------------ FLOPs

@dataclass(frozen=True)
class GatedDeltaNetFlops:
    """One layer's forward FLOPs per token (a multiply-add is 2), by part. The chunked
    rule's products count whole chunk x chunk blocks (as they are computed, the masked
    half too) and the padding of the last chunk; its triangular solve counts chunk^2 per
    right-hand column. Elementwise work (decays, norms, gates) is left out."""
    projections: float  # in_proj_qkv, _z, _b, _a and out_proj
    conv: float  # kernel taps per channel
    chunk_products: float  # the rule's matrix products
    solve: float  # the rule's triangular solve

    @property
    def delta_rule(self) -> float:
        return self.chunk_products + self.solve

    @property
    def total(self) -> float:
        return self.projections + self.conv + self.delta_rule


def forward_flops_per_token(args, seq_len: int, chunk_size: int = CHUNK_SIZE
                            ) -> GatedDeltaNetFlops:
    """FLOPs per token of one layer's forward over ``seq_len`` tokens (the chunked rule)."""
    key_dim, value_dim, channels = _sizes(args)
    heads, c = args.linear_value_heads, chunk_size
    dk, dv = args.linear_key_head_dim, args.linear_value_head_dim
    projections = 2 * args.dim * (channels + value_dim + 2 * heads) + 2 * value_dim * args.dim
    # Per chunk and head: k_beta k^T and q k^T (c x c x dk), scores u (c x c x dv), and
    # reads S, q S, k^T u (c x dk x dv); the solve has dv + dk right-hand columns.
    per_chunk = 2 * c * c * (2 * dk + dv) + 3 * 2 * c * dk * dv
    chunks = math.ceil(seq_len / c)
    return GatedDeltaNetFlops(
        projections=projections,
        conv=2 * args.linear_conv_kernel * channels,
        chunk_products=heads * chunks * per_chunk / seq_len,
        solve=heads * chunks * c * c * (dk + dv) / seq_len)
