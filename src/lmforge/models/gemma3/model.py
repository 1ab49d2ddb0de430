"""The Gemma 3 text model (the 1B, and the language part of 4B/12B/27B).

Against Llama: RMSNorm scales by (1 + weight); each block normalises the input and the
output of both attention and MLP (four norms); q and k pass an RMSNorm over each head;
the MLP is GeGLU (gelu_tanh); embeddings are multiplied by sqrt(dim); scores are scaled by
``query_pre_attn_scalar ** -0.5``; most layers attend within a sliding window, with their
own RoPE base, and every ``sliding_pattern``-th layer attends globally.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.models.attention import attend, per_forward
from lmforge.models.common import DecoderStack, GatedMLP, KVCache, Projections
from lmforge.models.family import BlockSpec
from lmforge.models.llama.model import apply_rope

PROJECTIONS = Projections(
    attention=("q_proj", "k_proj", "v_proj", "o_proj"),
    mlp=("gate_proj", "up_proj", "down_proj"),
    aliases={"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
             "gate": "gate_proj", "up": "up_proj", "down": "down_proj"},
    lora_default=("q_proj", "v_proj"))

SLIDING, GLOBAL = "sliding", "global"


@dataclass(frozen=True)
class Gemma3Args:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ffn_dim: int
    explicit_head_dim: Optional[int] = None  # Gemma sizes heads apart from dim
    max_seq_len: int = 32768
    rope_theta: float = 1_000_000.0  # global layers
    rope_local_theta: float = 10_000.0  # sliding layers
    rope_linear_factor: float = 1.0  # global layers' positions divided by it (4B and up)
    query_pre_attn_scalar: float = 256.0
    sliding_window: Optional[int] = 512
    sliding_pattern: int = 6  # every sliding_pattern-th layer is global
    layer_types: Optional[tuple[str, ...]] = None  # per layer, where not the pattern
    norm_eps: float = 1e-6
    tie_embeddings: bool = True
    init_std: float = 0.02
    family: str = "gemma3_text"

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.dim // self.n_heads

    @property
    def attention_kinds(self) -> tuple[str, ...]:
        if self.layer_types is not None:
            return self.layer_types
        return tuple(GLOBAL if (i + 1) % self.sliding_pattern == 0 else SLIDING
                     for i in range(self.n_layers))

    @classmethod
    def from_dict(cls, recorded: dict) -> "Gemma3Args":
        """The inverse of ``dataclasses.asdict``."""
        kinds = recorded.get("layer_types")
        return cls(**{**recorded, "layer_types": tuple(kinds) if kinds else None})


class RMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), in fp32 (the weight starts at zero)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).type_as(x)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)


class ScaledEmbedding(nn.Embedding):
    """Token embeddings times sqrt(dim), the factor rounded to the weight's dtype."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        scale = torch.tensor(self.embedding_dim ** 0.5, dtype=self.weight.dtype)
        return super().forward(tokens) * scale.to(self.weight.device)


def rope_cos_sin(args: Gemma3Args, positions: torch.Tensor, sliding: bool):
    """cos/sin (batch, seq, head_dim) for a sliding (local base) or global layer."""
    d = args.head_dim
    base = args.rope_local_theta if sliding else args.rope_theta
    inv_freq = 1.0 / (base ** (
        torch.arange(0, d, 2, dtype=torch.int64, device=positions.device).float() / d))
    if not sliding:
        inv_freq = inv_freq / args.rope_linear_factor
    angles = positions.float()[..., None] * inv_freq  # (batch, seq, head_dim/2)
    angles = torch.cat([angles, angles], dim=-1)  # (batch, seq, head_dim)
    return angles.cos(), angles.sin()


class Attention(nn.Module):
    def __init__(self, args: Gemma3Args, sliding: bool):
        super().__init__()
        self.args, self.sliding, self.head_dim = args, sliding, args.head_dim
        hd = args.head_dim
        self.q_proj = nn.Linear(args.dim, args.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(args.dim, args.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(args.dim, args.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(args.n_heads * hd, args.dim, bias=False)
        self.q_norm = RMSNorm(hd, args.norm_eps)
        self.k_norm = RMSNorm(hd, args.norm_eps)

    def forward(self, x, positions=None, mask=None, cache: Optional[KVCache] = None):
        batch, seq, _ = x.shape
        past = cache.length if cache is not None else 0
        if positions is None:
            positions = torch.arange(past, past + seq, device=x.device).expand(batch, seq)
        cos, sin = per_forward(mask, ("rope", self.sliding),  # (batch, seq, hd) each
                               lambda: rope_cos_sin(self.args, positions, self.sliding))
        q = self.q_norm(self.q_proj(x).view(batch, seq, -1, self.head_dim))  # (b, s, h, hd)
        k = self.k_norm(self.k_proj(x).view(batch, seq, -1, self.head_dim))  # (b, s, kv, hd)
        v = self.v_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)  # (b, kv, s, hd)
        q, k = apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin)
        if cache is not None:
            k, v = cache.append(k, v)  # (b, kv, past + s, hd)
        out = attend(q, k, v, mask, past=past,
                     window=self.args.sliding_window if self.sliding else None,
                     scale=self.args.query_pre_attn_scalar ** -0.5)  # (b, h, s, hd)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(GatedMLP):
    """GeGLU: down(gelu_tanh(gate(x)) * up(x))."""

    def __init__(self, args: Gemma3Args):
        super().__init__(args.dim, args.ffn_dim, "gelu_tanh")


class Gemma3Block(nn.Module):
    NORMS = ("attention_norm", "post_attention_norm", "ffn_norm", "post_ffn_norm")

    def __init__(self, args: Gemma3Args, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        for name in self.NORMS:
            setattr(self, name, RMSNorm(args.dim, args.norm_eps))
        self.attention = Attention(args, args.attention_kinds[layer_id] == SLIDING)
        self.feed_forward = FeedForward(args)

    def forward(self, x, positions=None, mask=None, cache=None):
        h = x + self.post_attention_norm(
            self.attention(self.attention_norm(x), positions, mask, cache))
        return h + self.post_ffn_norm(self.feed_forward(self.ffn_norm(h)))

    def reset_parameters(self, std: float, n_layers: int) -> None:
        out_std = std / math.sqrt(2 * n_layers)  # residual outputs shrink with depth
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.reset_parameters()
        a = self.attention
        for proj, s in ((a.q_proj, std), (a.k_proj, std), (a.v_proj, std), (a.o_proj, out_std)):
            nn.init.trunc_normal_(proj.weight, std=s, a=-3 * s, b=3 * s)
        self.feed_forward.reset_parameters(std, out_std)


class Gemma3(DecoderStack):
    def __init__(self, args: Gemma3Args):
        super().__init__(args, Gemma3Block, RMSNorm(args.dim, args.norm_eps), output_bias=False)
        self.tok_embeddings = ScaledEmbedding(args.vocab_size, args.dim)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight


def block_spec(args: Gemma3Args) -> BlockSpec:
    """One block as parallelism, LoRA and the performance model see it."""
    d, hd = args.dim, args.head_dim
    return BlockSpec(
        shapes={"q_proj": (d, args.n_heads * hd), "k_proj": (d, args.n_kv_heads * hd),
                "v_proj": (d, args.n_kv_heads * hd), "o_proj": (args.n_heads * hd, d),
                "gate_proj": (d, args.ffn_dim), "up_proj": (d, args.ffn_dim),
                "down_proj": (args.ffn_dim, d)},
        norm="rms_one_plus", norms=Gemma3Block.NORMS, post_norms=True, mlp="geglu",
        head_norms=True, rotary_features=hd,
        attention=args.attention_kinds, sliding_window=args.sliding_window)
