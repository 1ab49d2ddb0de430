"""The Llama model: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU.

Plain PyTorch, nothing about parallelism, LoRA or quantization: those are applied from
outside by swapping modules. Layers sit in an ``nn.ModuleDict`` keyed by layer id and
``forward`` skips a missing embedding, norm or head, so pipeline stages keep the same
parameter names as the whole model.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.models.common import DecoderStack, GatedMLP, KVCache, Projections, causal_mask
from lmforge.models.family import BlockSpec

# Hugging Face's names for the block's linear layers, and the names users also give them.
PROJECTIONS = Projections(
    attention=("q_proj", "k_proj", "v_proj", "o_proj"),
    mlp=("gate_proj", "up_proj", "down_proj"),
    aliases={"q": "q_proj", "wq": "q_proj", "k": "k_proj", "wk": "k_proj",
             "v": "v_proj", "wv": "v_proj", "o": "o_proj", "wo": "o_proj",
             "gate": "gate_proj", "w1": "gate_proj", "up": "up_proj", "w3": "up_proj",
             "down": "down_proj", "w2": "down_proj"},
    lora_default=("q_proj", "v_proj"))


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1 frequency scaling for long contexts."""
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class LlamaArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ffn_dim: int
    max_seq_len: int = 4096
    rope_theta: float = 10000.0
    rope_scaling: Optional[RopeScaling] = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    # The Llama-shaped families differ from Llama only in these flags (issue #15).
    family: str = "llama"  # HF model_type: llama | mistral | qwen2 | qwen3
    # Qwen3 and Mistral Nemo size heads independently of dim. A separate name from the
    # ``head_dim`` property so ``dataclasses.replace(args, dim=...)`` never keeps a stale one.
    explicit_head_dim: Optional[int] = None
    attention_bias: bool = False  # Qwen2: biases on q/k/v (never on o)
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on each q and k head, before RoPE
    sliding_window: Optional[int] = None  # Mistral: a query sees at most this many keys

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.dim // self.n_heads

    @classmethod
    def from_dict(cls, recorded: dict) -> "LlamaArgs":
        """The inverse of ``dataclasses.asdict``."""
        scaling = recorded.get("rope_scaling")
        return cls(**{**recorded, "rope_scaling": RopeScaling(**scaling) if scaling else None})


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 whatever the activation dtype: bf16 squares lose too much.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


# ------------------------------------------------------------------------------ RoPE

def rope_frequencies(args: LlamaArgs, device=None) -> torch.Tensor:
    """Inverse frequencies theta^(-2i/d), with Llama-3 scaling when configured."""
    d = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (
        torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
    s = args.rope_scaling
    if s is None:
        return inv_freq
    # Long wavelengths (low frequencies) are slowed by `factor`, short ones kept, and the
    # band between the two thresholds interpolated smoothly.
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(args: LlamaArgs, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for integer ``positions`` (batch, seq) in the rotate-half layout."""
    inv_freq = rope_frequencies(args, positions.device)
    angles = positions.float()[..., None] * inv_freq  # (batch, seq, head_dim/2)
    angles = torch.cat([angles, angles], dim=-1)  # (batch, seq, head_dim)
    return angles.cos(), angles.sin()


def interleaved_to_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder q/k rows within each head from pairs (0,1),(2,3),... to halves (0,d/2),...
    (HF's convert_llama_weights_to_hf ``permute``)."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def half_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (batch, heads, seq, head_dim); cos/sin: (batch, seq, head_dim)
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    return x * cos + rotate_half(x) * sin


# ------------------------------------------------------------------------- attention

class Attention(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.args = args
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        bias = args.attention_bias
        self.q_proj = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=bias)
        self.k_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=bias)
        self.v_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=bias)
        self.o_proj = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        if args.qk_norm:  # one weight shared by all heads, so tensor parallelism replicates it
            self.q_norm = RMSNorm(args.head_dim, args.norm_eps)
            self.k_norm = RMSNorm(args.head_dim, args.norm_eps)

    def forward(self, x, positions=None, mask=None, cache: Optional[KVCache] = None):
        batch, seq, _ = x.shape
        past = cache.length if cache is not None else 0
        if positions is None:
            positions = torch.arange(past, past + seq, device=x.device).expand(batch, seq)
        # Computed here, from the full sequence, because under sequence parallelism the
        # block's input is only this rank's slice of it.
        cos, sin = rope_cos_sin(self.args, positions)  # (batch, seq, head_dim)
        # -1 instead of the head counts: under tensor parallelism each rank holds a slice.
        q = self.q_proj(x).view(batch, seq, -1, self.head_dim)  # (b, s, h, hd)
        k = self.k_proj(x).view(batch, seq, -1, self.head_dim)  # (b, s, kv, hd)
        if self.args.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (b, h, s, hd), (b, kv, s, hd)
        v = self.v_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)  # (b, kv, s, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.append(k, v)  # (b, kv, past + s, hd)
        gqa = q.shape[1] != k.shape[1]
        # Per layer, from the gathered sequence, not once in the model's forward: there, a
        # later pipeline stage's input under sequence parallelism is only this rank's slice.
        mask = sliding_window_mask(mask, seq, past, self.args.sliding_window, x.device)
        if mask is None and past > 0 and seq > 1:
            mask = causal_mask(seq, past, x.device)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None and past == 0, enable_gqa=gqa)
        out = out.transpose(1, 2).reshape(batch, seq, -1)  # (b, s, h * hd)
        return self.o_proj(out)

    def reset_parameters(self, std: float, out_std: float) -> None:
        for proj in (self.q_proj, self.k_proj, self.v_proj):
            nn.init.trunc_normal_(proj.weight, std=std, a=-3 * std, b=3 * std)
            if proj.bias is not None:
                nn.init.zeros_(proj.bias)
        if self.args.qk_norm:
            self.q_norm.reset_parameters()
            self.k_norm.reset_parameters()
        nn.init.trunc_normal_(self.o_proj.weight, std=out_std, a=-3 * out_std, b=3 * out_std)


def sliding_window_mask(mask: Optional[torch.Tensor], seq: int, past: int,
                        window: Optional[int], device) -> Optional[torch.Tensor]:
    """``mask`` narrowed so query i sees keys j with i - window < j <= i (transformers'
    sliding-window mask: the window counts the query itself). Unchanged, keeping SDPA's
    fast causal path, when no query has more than ``window`` keys."""
    if window is None or past + seq <= window:
        return mask
    q_pos = torch.arange(past, past + seq, device=device)[:, None]
    k_pos = torch.arange(past + seq, device=device)[None, :]
    window_mask = (k_pos <= q_pos) & (k_pos > q_pos - window)  # (seq, past + seq)
    return window_mask if mask is None else mask & window_mask


class FeedForward(GatedMLP):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, args: LlamaArgs):
        super().__init__(args.dim, args.ffn_dim, "silu")


class TransformerBlock(nn.Module):
    def __init__(self, args: LlamaArgs, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x, positions=None, mask=None, cache=None):
        h = x + self.attention(self.attention_norm(x), positions, mask, cache)
        return h + self.feed_forward(self.ffn_norm(h))

    def reset_parameters(self, std: float, n_layers: int) -> None:
        # Residual-branch outputs shrink with depth so the residual stream keeps unit scale.
        out_std = std / math.sqrt(2 * n_layers)
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.reset_parameters(std, out_std)
        self.feed_forward.reset_parameters(std, out_std)


class Llama(DecoderStack):
    def __init__(self, args: LlamaArgs):
        super().__init__(args, TransformerBlock, RMSNorm(args.dim, args.norm_eps),
                         output_bias=False)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Random initialisation, called after ``to_empty`` on the target device."""
        std = self.args.init_std
        if self.tok_embeddings is not None:
            # (a tied embedding is the head, also on a first pipeline stage without it)
            head = self.output is not None or self.args.tie_embeddings
            nn.init.normal_(self.tok_embeddings.weight, std=std if head else 1.0)
        for layer in self.layers.values():
            layer.reset_parameters(std, self.args.n_layers)
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None and not self.args.tie_embeddings:
            bound = 3 * std
            nn.init.trunc_normal_(self.output.weight, std=std, a=-bound, b=bound)


def build_llama(args: LlamaArgs, device: str | torch.device = "meta") -> Llama:
    """Construct on ``device`` (meta by default: no memory is touched, so a 70B preset is
    free to build). Allocate with ``materialize``."""
    with torch.device(device):
        return Llama(args)


def projection_shapes(args: LlamaArgs) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection of one block."""
    d, hd = args.dim, args.head_dim
    return {"q_proj": (d, args.n_heads * hd), "k_proj": (d, args.n_kv_heads * hd),
            "v_proj": (d, args.n_kv_heads * hd), "o_proj": (args.n_heads * hd, d),
            "gate_proj": (d, args.ffn_dim), "up_proj": (d, args.ffn_dim),
            "down_proj": (args.ffn_dim, d)}


def block_spec(args: LlamaArgs) -> BlockSpec:
    """One block as parallelism, LoRA and the performance model see it."""
    window = args.sliding_window
    return BlockSpec(
        shapes=projection_shapes(args), rotary_features=args.head_dim,
        head_norms=args.qk_norm,
        biased=("q_proj", "k_proj", "v_proj") if args.attention_bias else (),
        attention=("sliding" if window else "global",) * args.n_layers, sliding_window=window)
