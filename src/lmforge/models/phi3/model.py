"""The Phi-3 model (Phi-3-mini 4k/128k, Phi-4-mini): Llama's block with q, k and v in one
projection (``qkv_proj``) and gate and up in another (``gate_up_proj``), partial rotary
embeddings, and LongRoPE for contexts past the pretraining length.

A fused projection keeps its output rows grouped (``models.family.Fused``): qkv as one
group per kv head (its queries, then its key, then its value), gate_up as one (gate, up)
pair per hidden unit. A tensor-parallel rank holding a contiguous run of rows therefore
holds whole groups, and the forward below reads them whatever their number.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.models.attention import attend, per_forward
from lmforge.models.common import DecoderStack, KVCache, Projections
from lmforge.models.family import BlockSpec, Fused
from lmforge.models.llama.model import RMSNorm, rotate_half

# Hugging Face's (and peft's) names for the block's linear layers.
PROJECTIONS = Projections(
    attention=("qkv_proj", "o_proj"), mlp=("gate_up_proj", "down_proj"),
    aliases={"qkv": "qkv_proj", "o": "o_proj", "gate_up": "gate_up_proj",
             "down": "down_proj"},
    lora_default=("qkv_proj",),
    fused_parts={"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
                 "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"})


@dataclass(frozen=True)
class LongRope:
    """LongRoPE: per-frequency divisors for sequences up to the pretraining length
    (``short_factor``) and past it (``long_factor``), and a scale on cos and sin."""
    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    attention_factor: float


@dataclass(frozen=True)
class Phi3Args:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ffn_dim: int
    max_seq_len: int = 4096
    rope_theta: float = 10000.0
    rope_scaling: Optional[LongRope] = None
    partial_rotary_factor: float = 1.0  # the share of each head's features that rotate
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    sliding_window: Optional[int] = None
    family: str = "phi3"

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_dict(cls, recorded: dict) -> "Phi3Args":
        """The inverse of ``dataclasses.asdict``."""
        rope = recorded.get("rope_scaling")
        if rope:
            rope = LongRope(**{**rope, "short_factor": tuple(rope["short_factor"]),
                               "long_factor": tuple(rope["long_factor"])})
        return cls(**{**recorded, "rope_scaling": rope})


def qkv_fused(args: Phi3Args) -> Fused:
    hd = args.head_dim
    return Fused(parts=(("q", args.n_heads * hd), ("k", args.n_kv_heads * hd),
                        ("v", args.n_kv_heads * hd)), groups=args.n_kv_heads)


def gate_up_fused(args: Phi3Args) -> Fused:
    return Fused(parts=(("gate", args.ffn_dim), ("up", args.ffn_dim)), groups=args.ffn_dim)


# ------------------------------------------------------------------------------ RoPE

def rope_cos_sin(args: Phi3Args, positions: torch.Tensor,
                 per_row: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables (batch, seq, rotary_dim) in the rotate-half layout. With LongRoPE
    the long factors apply when the batch reaches past the pretraining length (the
    largest position, as transformers decides), and cos and sin are scaled. ``per_row``
    (batched decoding): each row by its own largest position, as that prompt alone."""
    d = args.rotary_dim
    inv_freq = 1.0 / (args.rope_theta ** (
        torch.arange(0, d, 2, dtype=torch.int64, device=positions.device).float() / d))
    scale = 1.0
    rope = args.rope_scaling
    if rope is not None:
        short = torch.tensor(rope.short_factor, device=positions.device)
        long = torch.tensor(rope.long_factor, device=positions.device)
        largest = positions.amax(-1, keepdim=True)[..., None] if per_row else positions.max()
        beyond = largest + 1 > rope.original_max_position_embeddings  # (batch, 1, 1) or ()
        inv_freq = inv_freq / torch.where(beyond, long, short)  # no host sync
        scale = rope.attention_factor
    angles = positions.float()[..., None] * inv_freq  # (batch, seq, rotary_dim/2)
    angles = torch.cat([angles, angles], dim=-1)  # (batch, seq, rotary_dim)
    return angles.cos() * scale, angles.sin() * scale


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` features of each head; pass the rest."""
    # x: (batch, heads, seq, head_dim); cos/sin: (batch, seq, rotary_dim)
    n = cos.shape[-1]
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    rot, keep = x[..., :n], x[..., n:]
    return torch.cat([rot * cos + rotate_half(rot) * sin, keep], dim=-1)


# ------------------------------------------------------------------------ the block

class Attention(nn.Module):
    def __init__(self, args: Phi3Args):
        super().__init__()
        self.args = args
        self.head_dim = args.head_dim
        self.queries_per_kv = args.n_heads // args.n_kv_heads
        self.qkv_proj = nn.Linear(args.dim, qkv_fused(args).rows, bias=False)
        self.o_proj = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x, positions=None, mask=None, cache: Optional[KVCache] = None):
        batch, seq, _ = x.shape
        past = cache.length if cache is not None else 0
        if positions is None:
            positions = torch.arange(past, past + seq, device=x.device).expand(batch, seq)
        cos, sin = per_forward(mask, "rope", lambda: rope_cos_sin(  # (b, s, rd) each
            self.args, positions, per_row=cache is not None))
        # One group per kv head: its queries, its key, its value (-1: this rank's groups).
        qkv = self.qkv_proj(x).view(batch, seq, -1, self.queries_per_kv + 2, self.head_dim)
        q = qkv[:, :, :, :-2].reshape(batch, seq, -1, self.head_dim)  # (b, s, h, hd)
        k, v = qkv[:, :, :, -2], qkv[:, :, :, -1]  # (b, s, kv, hd)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_partial_rope(q, cos, sin), apply_partial_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.append(k, v)  # (b, kv, past + s, hd)
        out = attend(q, k, v, mask, past=past, window=self.args.sliding_window)  # (b,h,s,hd)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU with gate and up in one projection: down(silu(gate) * up)."""

    def __init__(self, args: Phi3Args):
        super().__init__()
        self.gate_up_proj = nn.Linear(args.dim, 2 * args.ffn_dim, bias=False)
        self.down_proj = nn.Linear(args.ffn_dim, args.dim, bias=False)

    def forward(self, x):
        gate_up = self.gate_up_proj(x).unflatten(-1, (-1, 2))  # (b, s, ffn, 2): pairs
        return self.down_proj(F.silu(gate_up[..., 0]) * gate_up[..., 1])


class Phi3Block(nn.Module):
    def __init__(self, args: Phi3Args, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)  # HF: input_layernorm
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)  # HF: post_attention_layernorm
        self.feed_forward = FeedForward(args)

    def forward(self, x, positions=None, mask=None, cache=None):
        h = x + self.attention(self.attention_norm(x), positions, mask, cache)
        return h + self.feed_forward(self.ffn_norm(h))

    def reset_parameters(self, std: float, n_layers: int) -> None:
        out_std = std / math.sqrt(2 * n_layers)  # residual outputs shrink with depth
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        for proj, s in ((self.attention.qkv_proj, std), (self.attention.o_proj, out_std),
                        (self.feed_forward.gate_up_proj, std),
                        (self.feed_forward.down_proj, out_std)):
            nn.init.trunc_normal_(proj.weight, std=s, a=-3 * s, b=3 * s)


class Phi3(DecoderStack):
    def __init__(self, args: Phi3Args):
        super().__init__(args, Phi3Block, RMSNorm(args.dim, args.norm_eps), output_bias=False)


def block_spec(args: Phi3Args) -> BlockSpec:
    """One block as parallelism, LoRA and the performance model see it."""
    d, hd, qkv = args.dim, args.head_dim, qkv_fused(args)
    window = args.sliding_window
    return BlockSpec(
        shapes={"qkv_proj": (d, qkv.rows), "o_proj": (args.n_heads * hd, d),
                "gate_up_proj": (d, 2 * args.ffn_dim), "down_proj": (args.ffn_dim, d)},
        fused={"qkv_proj": qkv, "gate_up_proj": gate_up_fused(args)},
        rotary_features=args.rotary_dim, sliding_window=window,
        attention=("sliding" if window else "global",) * args.n_layers)
