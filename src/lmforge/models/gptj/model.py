"""GPT-J (Wang & Komatsuzaki, 2021): one LayerNorm feeding attention and the MLP in
parallel, ``h = x + attn(ln(x)) + mlp(ln(x))``; rotary embeddings on the first
``rotary_dim`` features of each head, in the interleaved (rotate-every-two) layout;
no biases on q/k/v/out; a GELU MLP with biases; an untied output head with a bias.

Plain PyTorch, laid out like ``models/llama/model.py`` (``tok_embeddings``, ``layers`` by
layer id, ``norm``, ``output``; blocks with ``attention_norm``, ``attention``,
``feed_forward``), so pipeline stages, checkpoints and LoRA treat both alike.
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
from lmforge.models.family import BlockSpec

# Hugging Face's names for the block's linear layers, and the names users also give them.
PROJECTIONS = Projections(
    attention=("q_proj", "k_proj", "v_proj", "out_proj"), mlp=("fc_in", "fc_out"),
    aliases={"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "out_proj", "out": "out_proj",
             "o_proj": "out_proj"},
    lora_default=("q_proj", "v_proj"))


@dataclass(frozen=True)
class GPTJArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int  # always n_heads: GPT-J has no grouped-query attention
    vocab_size: int
    ffn_dim: int
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    rotary_dim: Optional[int] = None  # features of each head that rotate; None: all
    family: str = "gptj"

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def rotary_features(self) -> int:
        return self.rotary_dim or self.head_dim

    @property
    def sliding_window(self) -> None:  # every query sees every earlier key
        return None


def rotary_cos_sin(args: GPTJArgs, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for integer ``positions`` (batch, seq), each angle repeated for the two
    features of its pair: (batch, seq, rotary_features)."""
    d = args.rotary_features
    inv_freq = 1.0 / (args.rope_theta ** (
        torch.arange(0, d, 2, dtype=torch.int64, device=positions.device).float() / d))
    angles = positions.float()[..., None] * inv_freq  # (batch, seq, d/2)
    angles = angles.repeat_interleave(2, dim=-1)  # (batch, seq, d): pairs (0,1), (2,3), ...
    return angles.cos(), angles.sin()


def rotate_every_two(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)."""
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (batch, seq, heads, head_dim); only the first cos.shape[-1] features rotate.
    d = cos.shape[-1]
    cos, sin = cos[:, :, None].to(x.dtype), sin[:, :, None].to(x.dtype)
    rot, rest = x[..., :d], x[..., d:]
    return torch.cat([rot * cos + rotate_every_two(rot) * sin, rest], dim=-1)


class Attention(nn.Module):
    def __init__(self, args: GPTJArgs):
        super().__init__()
        self.args, self.head_dim = args, args.head_dim
        self.q_proj = nn.Linear(args.dim, args.dim, bias=False)
        self.k_proj = nn.Linear(args.dim, args.dim, bias=False)
        self.v_proj = nn.Linear(args.dim, args.dim, bias=False)
        self.out_proj = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x, positions=None, mask=None, cache: Optional[KVCache] = None):
        batch, seq, _ = x.shape
        past = cache.length if cache is not None else 0
        if positions is None:
            positions = torch.arange(past, past + seq, device=x.device).expand(batch, seq)
        cos, sin = per_forward(mask, "rope", lambda: rotary_cos_sin(self.args, positions))
        # (batch, seq, rotary_features) each
        # -1 instead of the head count: under tensor parallelism each rank holds a slice.
        q = apply_rotary(self.q_proj(x).view(batch, seq, -1, self.head_dim), cos, sin)
        k = apply_rotary(self.k_proj(x).view(batch, seq, -1, self.head_dim), cos, sin)
        v = self.v_proj(x).view(batch, seq, -1, self.head_dim)  # (b, s, h, hd)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (b, h, s, hd)
        if cache is not None:
            k, v = cache.append(k, v)  # (b, h, past + s, hd)
        out = attend(q, k, v, mask, past=past)  # (b, h, s, hd)
        return self.out_proj(out.transpose(1, 2).reshape(batch, seq, -1))  # (b, s, dim)

    def reset_parameters(self, std: float, out_std: float) -> None:
        for proj, s in ((self.q_proj, std), (self.k_proj, std), (self.v_proj, std),
                        (self.out_proj, out_std)):
            nn.init.trunc_normal_(proj.weight, std=s, a=-3 * s, b=3 * s)


class FeedForward(nn.Module):
    """fc_out(gelu_tanh(fc_in(x))), both with biases."""

    def __init__(self, args: GPTJArgs):
        super().__init__()
        self.fc_in = nn.Linear(args.dim, args.ffn_dim)
        self.fc_out = nn.Linear(args.ffn_dim, args.dim)

    def forward(self, x):
        return self.fc_out(F.gelu(self.fc_in(x), approximate="tanh"))

    def reset_parameters(self, std: float, out_std: float) -> None:
        for proj, s in ((self.fc_in, std), (self.fc_out, out_std)):
            nn.init.trunc_normal_(proj.weight, std=s, a=-3 * s, b=3 * s)
            nn.init.zeros_(proj.bias)


class TransformerBlock(nn.Module):
    def __init__(self, args: GPTJArgs, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = nn.LayerNorm(args.dim, eps=args.norm_eps)  # HF: ln_1
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args)

    def forward(self, x, positions=None, mask=None, cache=None):
        h = self.attention_norm(x)  # one norm, read by both branches
        return x + self.attention(h, positions, mask, cache) + self.feed_forward(h)

    def reset_parameters(self, std: float, n_layers: int) -> None:
        # Both branches add to the residual stream, 2 * n_layers outputs in all.
        out_std = std / math.sqrt(2 * n_layers)
        self.attention_norm.reset_parameters()
        self.attention.reset_parameters(std, out_std)
        self.feed_forward.reset_parameters(std, out_std)


class GPTJ(DecoderStack):
    def __init__(self, args: GPTJArgs):
        super().__init__(args, TransformerBlock, nn.LayerNorm(args.dim, eps=args.norm_eps),
                         output_bias=True)


def projection_shapes(args: GPTJArgs) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection of one block."""
    d = args.dim
    return {"q_proj": (d, d), "k_proj": (d, d), "v_proj": (d, d), "out_proj": (d, d),
            "fc_in": (d, args.ffn_dim), "fc_out": (args.ffn_dim, d)}


def block_spec(args: GPTJArgs) -> BlockSpec:
    """One block as parallelism, LoRA and the performance model see it: one LayerNorm read
    by attention and MLP in parallel, a GELU MLP with biases, partial rotary."""
    return BlockSpec(
        shapes=projection_shapes(args), norm="layer", norms=("attention_norm",), mlp="gelu",
        parallel=True, biased=("fc_in", "fc_out", "output"),
        rotary_features=args.rotary_features, attention=("global",) * args.n_layers)
