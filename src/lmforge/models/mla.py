"""Multi-head latent attention (MLA), DeepSeek-V2/V3's attention.

Keys and values come from a small latent: the input is projected down to
``kv_lora_rank`` features (normalised), and ``kv_b_proj`` expands that latent to each
head's key part without position (``qk_nope_head_dim``) and its value (``v_head_dim``).
Position enters through a separate ``qk_rope_head_dim`` slice: one rotary key per token,
projected straight from the input and shared by every head, concatenated to each head's
key; each query head has its rotary slice too. Queries are projected through a latent of
their own (``q_lora_rank``), or directly (``q_proj``) when it is None.

Parameter names are transformers' ``DeepseekV3Attention`` leaf names, so mapping a
checkpoint is names only. The KV cache holds the expanded per-head keys and values (a
``KVCache`` whose values have their own head dim), not the latent: decoding then takes
the same ``attend`` path as every family.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from lmforge.models.attention import attend, per_forward
from lmforge.models.common import KVCache
from lmforge.models.llama.model import RMSNorm, _yarn, apply_rope

# DeepSeek's latent norms use 1e-6 whatever the config's rms_norm_eps (its reference code
# and transformers build them with the default), so a checkpoint's numbers need this one.
LATENT_NORM_EPS = 1e-6


@dataclass(frozen=True)
class YarnScaling:
    """DeepSeek's YaRN: frequencies as llama's ``yarn`` (``_yarn``), and two "mscale"s.
    cos and sin are scaled by mscale(factor, mscale) / mscale(factor, mscale_all_dim),
    and the softmax by mscale(factor, mscale_all_dim)^2, where mscale(s, m) =
    0.1 m ln(s) + 1. With both equal (DeepSeek-V3: 1.0) the rotary slice is unscaled and
    the whole score, rotary and not, is sharpened alike. Defaults: DeepSeek-V3's."""
    factor: float = 40.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: Optional[float] = 1.0  # None: absent from the config
    mscale_all_dim: Optional[float] = 1.0
    truncate: bool = True  # the correction band rounded outwards to whole dimensions

    def _mscale(self, m: float) -> float:
        return 1.0 if self.factor <= 1 else 0.1 * m * math.log(self.factor) + 1.0

    @property
    def cos_sin_scale(self) -> float:
        # (transformers takes the ratio only when both are set, else plain YaRN's factor)
        if self.mscale and self.mscale_all_dim:
            return self._mscale(self.mscale) / self._mscale(self.mscale_all_dim)
        return self._mscale(1.0)

    @property
    def softmax_scale_factor(self) -> float:
        return self._mscale(self.mscale_all_dim) ** 2 if self.mscale_all_dim else 1.0


@dataclass(frozen=True)
class MLAArgs:
    """What ``MLAttention`` reads (any object with these attribute names will do)."""
    dim: int
    n_heads: int
    q_lora_rank: Optional[int]  # None: a plain q_proj (DeepSeek-V2-Lite, Moonlight)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: Optional[YarnScaling] = None
    rope_interleave: bool = True  # DeepSeek's checkpoints pair rotary features (0,1),(2,3)..
    norm_eps: float = 1e-6  # the block's norms (the latent norms: LATENT_NORM_EPS)
    attention_bias: bool = False  # on q_a_proj, kv_a_proj_with_mqa and o_proj

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    # What ``KVCache.empty`` reads: the cache holds every head's full key (and value).
    @property
    def head_dim(self) -> int:
        return self.qk_head_dim

    @property
    def n_kv_heads(self) -> int:
        return self.n_heads


# ------------------------------------------------------------------------------ RoPE

def mla_rope_cos_sin(args, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin (batch, seq, qk_rope_head_dim) for integer ``positions`` (batch, seq), in
    the rotate-half layout, with DeepSeek's YaRN scaling if any."""
    d = args.qk_rope_head_dim
    inv_freq = 1.0 / (args.rope_theta ** (
        torch.arange(0, d, 2, dtype=torch.int64, device=positions.device).float() / d))
    scaling = args.rope_scaling
    if scaling is not None:
        inv_freq = _yarn(inv_freq, scaling, args.rope_theta, d)
    angles = positions.float()[..., None] * inv_freq  # (batch, seq, d/2)
    angles = torch.cat([angles, angles], dim=-1)  # (batch, seq, d)
    scale = scaling.cos_sin_scale if scaling is not None else 1.0
    return angles.cos() * scale, angles.sin() * scale


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Features (x0, x1), (x2, x3), ... -> (x0, x2, ..., x1, x3, ...): DeepSeek's paired
    rotary layout to rotate-half's. The same reordering of q and k leaves their dot
    product unchanged, so the rotated keys may stay (and be cached) in this order."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


# ------------------------------------------------------------------------- attention

class MLAttention(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.qk_head_dim = args.qk_nope_head_dim + args.qk_rope_head_dim
        bias = args.attention_bias
        q_out = args.n_heads * self.qk_head_dim
        if args.q_lora_rank is None:
            self.q_proj = nn.Linear(args.dim, q_out, bias=False)
        else:
            self.q_a_proj = nn.Linear(args.dim, args.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(args.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(args.q_lora_rank, q_out, bias=False)
        # The latent and the shared rotary key, in one projection.
        self.kv_a_proj_with_mqa = nn.Linear(
            args.dim, args.kv_lora_rank + args.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(args.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(
            args.kv_lora_rank, args.n_heads * (args.qk_nope_head_dim + args.v_head_dim),
            bias=False)
        self.o_proj = nn.Linear(args.n_heads * args.v_head_dim, args.dim, bias=bias)
        scaling = args.rope_scaling
        self.softmax_scale = self.qk_head_dim ** -0.5 * (
            scaling.softmax_scale_factor if scaling is not None else 1.0)

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        if self.args.q_lora_rank is None:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.args.rope_interleave:
            x = deinterleave(x)
        return apply_rope(x, cos, sin)

    def forward(self, x, positions=None, mask=None, cache: Optional[KVCache] = None):
        """As llama's ``Attention.forward``: x (batch, seq, dim); positions (batch, seq),
        default after the cached ones; mask: None (causal), a ``DocumentMask``, a boolean
        mask or a ``DecodeMask``; ``cache`` takes every head's keys and values."""
        batch, seq, _ = x.shape
        nope, rope, v_dim = (self.args.qk_nope_head_dim, self.args.qk_rope_head_dim,
                             self.args.v_head_dim)
        past = cache.length if cache is not None else 0
        if positions is None:
            positions = torch.arange(past, past + seq, device=x.device).expand(batch, seq)
        # (once per decoder step, shared by the layers, under a DecodeMask)
        cos, sin = per_forward(mask, "mla_rope",
                               lambda: mla_rope_cos_sin(self.args, positions))  # (b, s, rope)
        # -1 instead of the head count: under tensor parallelism each rank holds a slice.
        q = self.queries(x).view(batch, seq, -1, self.qk_head_dim)  # (b, s, h, qk)
        q_nope, q_rope = q.transpose(1, 2).split([nope, rope], dim=-1)  # (b, h, s, nope|rope)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split(
            [self.args.kv_lora_rank, rope], dim=-1)  # (b, s, kv_lora_rank), (b, s, rope)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent))  # (b, s, h * (nope + v))
        kv = kv.view(batch, seq, -1, nope + v_dim).transpose(1, 2)  # (b, h, s, nope + v)
        k_nope, v = kv.split([nope, v_dim], dim=-1)  # (b, h, s, nope), (b, h, s, v)
        q_rope = self.rotate(q_rope, cos, sin)
        k_rope = self.rotate(k_rope[:, None], cos, sin)  # (b, 1, s, rope): one for all heads
        q = torch.cat([q_nope, q_rope], dim=-1)  # (b, h, s, qk)
        k_rope = k_rope.expand(-1, k_nope.shape[1], -1, -1)  # (b, h, s, rope), no copy
        k = torch.cat([k_nope, k_rope], dim=-1)  # (b, h, s, qk)
        if cache is not None:
            k, v = cache.append(k, v)  # (b, h, past + s, qk), (b, h, past + s, v)
        out = attend(q, k, v, mask, past=past, scale=self.softmax_scale)  # (b, h, s, v)
        out = out.transpose(1, 2).reshape(batch, seq, -1)  # (b, s, h * v)
        return self.o_proj(out)

    def reset_parameters(self, std: float, out_std: float) -> None:
        """Truncated N(0, std) inputs, the output (which adds to the residual) ``out_std``,
        biases zero, the latent norms identity."""
        inputs = (("q_proj",) if self.args.q_lora_rank is None else ("q_a_proj", "q_b_proj"))
        for name in (*inputs, "kv_a_proj_with_mqa", "kv_b_proj"):
            _trunc_normal(getattr(self, name), std)
        _trunc_normal(self.o_proj, out_std)
        if self.args.q_lora_rank is not None:
            self.q_a_layernorm.reset_parameters()
        self.kv_a_layernorm.reset_parameters()


def _trunc_normal(proj: nn.Linear, std: float) -> None:
    nn.init.trunc_normal_(proj.weight, std=std, a=-3 * std, b=3 * std)
    if proj.bias is not None:
        nn.init.zeros_(proj.bias)
