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

from lmforge.models.attention import attend, per_forward
from lmforge.models.common import (DecoderStack, GatedMLP, KVCache, PreNormBlock,
                                   Projections)
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
    """RoPE scaling for a context longer than pretraining's, as transformers computes it:
    ``llama3`` (Llama 3.1's band-wise slowdown: the default), ``linear`` (every frequency
    divided by ``factor``: position interpolation) or ``yarn`` (YaRN: frequencies below
    the ``beta_slow`` .. ``beta_fast`` rotation band interpolated, above it kept, a ramp
    between; cos and sin scaled by ``attention_factor``, default 0.1 ln(factor) + 1)."""
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    kind: str = "llama3"  # transformers' rope_type
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: Optional[float] = None  # yarn: None = from factor
    truncate: bool = True  # yarn: the correction band rounded outwards to whole dimensions

    @property
    def cos_sin_scale(self) -> float:
        """What cos and sin are multiplied by (YaRN's attention factor; else 1)."""
        if self.kind != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        return 1.0 if self.factor <= 1 else 0.1 * math.log(self.factor) + 1.0


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
    """Inverse frequencies theta^(-2i/d), with the configured scaling (``RopeScaling``)."""
    d = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (
        torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
    s = args.rope_scaling
    if s is None:
        return inv_freq
    if s.kind == "linear":
        return inv_freq / s.factor
    if s.kind == "yarn":
        return _yarn(inv_freq, s, args.rope_theta, d)
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


def _yarn(inv_freq: torch.Tensor, s: RopeScaling, theta: float, d: int) -> torch.Tensor:
    """YaRN: dimensions that turn more than ``beta_fast`` times over the original context
    keep their frequency, those turning less than ``beta_slow`` times are interpolated
    (divided by ``factor``), and a linear ramp blends the band between."""
    def dim_of(rotations: float) -> float:  # the dimension turning this many times
        return d * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) \
            / (2 * math.log(theta))
    low, high = dim_of(s.beta_fast), dim_of(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    high = high + 0.001 if low == high else high  # (no zero-width ramp)
    ramp = ((torch.arange(d // 2, dtype=torch.float32, device=inv_freq.device) - low)
            / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep), 0: interpolate
    return inv_freq / s.factor * (1 - keep) + inv_freq * keep


def rope_cos_sin(args: LlamaArgs, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for integer ``positions`` (batch, seq) in the rotate-half layout."""
    inv_freq = rope_frequencies(args, positions.device)
    angles = positions.float()[..., None] * inv_freq  # (batch, seq, head_dim/2)
    angles = torch.cat([angles, angles], dim=-1)  # (batch, seq, head_dim)
    scale = args.rope_scaling.cos_sin_scale if args.rope_scaling is not None else 1.0
    if scale != 1.0:
        return angles.cos() * scale, angles.sin() * scale
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
        cos, sin = per_forward(mask, "rope", lambda: rope_cos_sin(self.args, positions))
        # (batch, seq, head_dim) each
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
        # The window's mask per layer, from the gathered sequence, not once in the model's
        # forward: there, a later pipeline stage's input under sequence parallelism is
        # only this rank's slice.
        out = attend(q, k, v, mask, past=past, window=self.args.sliding_window)
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


class FeedForward(GatedMLP):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, args: LlamaArgs):
        super().__init__(args.dim, args.ffn_dim, "silu")


class TransformerBlock(PreNormBlock):
    def __init__(self, args: LlamaArgs, layer_id: int):
        super().__init__(layer_id, RMSNorm(args.dim, args.norm_eps), Attention(args),
                         RMSNorm(args.dim, args.norm_eps), FeedForward(args))


class Llama(DecoderStack):
    block_class = TransformerBlock  # (Qwen3-MoE's and Mixtral's stack swaps the block)

    def __init__(self, args: LlamaArgs):
        super().__init__(args, self.block_class, RMSNorm(args.dim, args.norm_eps),
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
