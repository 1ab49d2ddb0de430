"""Qwen3.5's language model (transformers' ``qwen3_5_text``): a hybrid of Gated DeltaNet
(linear attention, ``models/gated_deltanet.py``) and gated full attention, one or the
other per layer as ``layer_types`` says (the released models: three linear layers, then
one full, repeated; read as given, never assumed).

The full-attention layers are Qwen3's (q/k norms, an explicit head_dim, grouped-query)
with two changes: the query projection also yields a per-head output gate, the
attention's output times sigmoid(gate) before o_proj; and only the first
``partial_rotary_factor`` of each head's features rotate. Every RMSNorm of the stack but
the DeltaNet's gated one is zero-centred, x / rms(x) * (1 + weight) in fp32 (Gemma's).
The MLP is Llama's SwiGLU.

The blocks keep Llama's names (``attention``, ``feed_forward``, the two norms): a linear
layer's ``attention`` is its ``GatedDeltaNet``, so a decoder cache per layer is either a
``KVCache`` or a ``GatedDeltaNetState`` (``new_cache``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from lmforge.models.attention import attend, per_forward
from lmforge.models.common import DecoderStack, KVCache, PreNormBlock, Projections
from lmforge.models.family import BlockSpec
from lmforge.models.gated_deltanet import (INPUT_PROJECTIONS, OUTPUT_PROJECTION, GatedDeltaNet,
                                           qkv_layout)
from lmforge.models.gemma3.model import RMSNorm as ZeroCenteredRMSNorm
from lmforge.models.llama.model import FeedForward, Llama, LlamaArgs, block_spec as llama_spec
from lmforge.models.phi3.model import apply_partial_rope

LINEAR, FULL = "linear_attention", "full_attention"
LAYER_TYPES = (LINEAR, FULL)

PROJECTIONS = Projections(
    attention=("q_proj", "k_proj", "v_proj", "o_proj"),
    mlp=("gate_proj", "up_proj", "down_proj"),
    aliases={"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
             "gate": "gate_proj", "up": "up_proj", "down": "down_proj"},
    lora_default=("q_proj", "v_proj"),
    linear_attention=(*INPUT_PROJECTIONS, OUTPUT_PROJECTION))


@dataclass(frozen=True)
class HybridArgs(LlamaArgs):
    """Llama's fields (the full-attention layers' heads, ``explicit_head_dim``), the layer
    pattern and the linear-attention layers' shape (config.json's ``linear_*``)."""
    family: str = "qwen3_5"
    layer_types: tuple[str, ...] = ()  # per layer: "linear_attention" | "full_attention"
    partial_rotary_factor: float = 0.25  # the share of a head's features that rotate
    linear_key_heads: int = 16  # linear_num_key_heads
    linear_value_heads: int = 32  # linear_num_value_heads (a multiple of the key heads)
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel: int = 4  # linear_conv_kernel_dim
    # The Qwen3_5ForConditionalGeneration directory this language model came from: its
    # vision tower (never trained here) and config are written back by an export. None:
    # a text-only model (Qwen3_5ForCausalLM).
    vision_from: Optional[str] = None

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_linear(self, layer_id: int) -> bool:
        return self.layer_types[layer_id] == LINEAR

    @classmethod
    def from_dict(cls, recorded: dict) -> "HybridArgs":
        """The inverse of ``dataclasses.asdict`` (JSON turns the tuple into a list)."""
        base = LlamaArgs.from_dict.__func__(cls, recorded)
        return dataclasses.replace(base, layer_types=tuple(recorded["layer_types"]))


def rope_cos_sin(args: HybridArgs, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin (batch, seq, rotary_dim) in the rotate-half layout over the rotating
    features. (The released configs' multimodal rotary gives a text token the same
    position on its three axes, which is this.)"""
    d = args.rotary_dim
    inv_freq = 1.0 / (args.rope_theta ** (
        torch.arange(0, d, 2, dtype=torch.int64, device=positions.device).float() / d))
    angles = positions.float()[..., None] * inv_freq  # (batch, seq, rotary_dim / 2)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


class GatedAttention(nn.Module):
    """Qwen3's attention whose query projection yields, per head, the query and then an
    output gate of the same width (transformers' layout, so a tensor-parallel column
    split by heads keeps each head's pair together)."""

    def __init__(self, args: HybridArgs):
        super().__init__()
        self.args, self.head_dim = args, args.head_dim
        hd = args.head_dim
        self.q_proj = nn.Linear(args.dim, args.n_heads * hd * 2, bias=False)
        self.k_proj = nn.Linear(args.dim, args.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(args.dim, args.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(args.n_heads * hd, args.dim, bias=False)
        self.q_norm = ZeroCenteredRMSNorm(hd, args.norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(hd, args.norm_eps)

    def forward(self, x, positions=None, mask=None, cache: Optional[KVCache] = None):
        batch, seq, _ = x.shape
        past = cache.length if cache is not None else 0
        if positions is None:
            positions = torch.arange(past, past + seq, device=x.device).expand(batch, seq)
        cos, sin = per_forward(mask, "rope", lambda: rope_cos_sin(self.args, positions))
        q, gate = self.q_proj(x).view(batch, seq, -1, 2 * self.head_dim).chunk(2, dim=-1)
        gate = gate.reshape(batch, seq, -1)  # (b, s, h * hd)
        q = self.q_norm(q).transpose(1, 2)  # (b, h, s, hd)
        k = self.k_norm(self.k_proj(x).view(batch, seq, -1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        q, k = apply_partial_rope(q, cos, sin), apply_partial_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.append(k, v)
        out = attend(q, k, v, mask, past=past)  # (b, h, s, hd)
        out = out.transpose(1, 2).reshape(batch, seq, -1) * torch.sigmoid(gate)
        return self.o_proj(out)

    def new_cache(self, batch: int, max_len: int, device, dtype) -> KVCache:
        return KVCache.empty(self.args, batch, max_len, device, dtype)

    def reset_parameters(self, std: float, out_std: float) -> None:
        for proj, s in ((self.q_proj, std), (self.k_proj, std), (self.v_proj, std),
                        (self.o_proj, out_std)):
            nn.init.trunc_normal_(proj.weight, std=s, a=-3 * s, b=3 * s)
        self.q_norm.reset_parameters()
        self.k_norm.reset_parameters()


class HybridBlock(PreNormBlock):
    """Llama's pre-norm block around a Gated DeltaNet or a gated attention."""

    def __init__(self, args: HybridArgs, layer_id: int):
        mixer = GatedDeltaNet(args) if args.is_linear(layer_id) else GatedAttention(args)
        super().__init__(layer_id, ZeroCenteredRMSNorm(args.dim, args.norm_eps), mixer,
                         ZeroCenteredRMSNorm(args.dim, args.norm_eps),
                         self.feed_forward_of(args, layer_id))

    @staticmethod
    def feed_forward_of(args: HybridArgs, layer_id: int) -> nn.Module:
        """Llama's MLP on every layer (the MoE families' blocks choose per layer)."""
        return FeedForward(args)


class Hybrid(Llama):
    """Llama's stack (its top level and initialisation) of ``HybridBlock``s, with the
    zero-centred final norm."""
    block_class = HybridBlock

    def __init__(self, args: HybridArgs):
        DecoderStack.__init__(self, args, self.block_class,
                              ZeroCenteredRMSNorm(args.dim, args.norm_eps), output_bias=False)


def block_spec(args: HybridArgs) -> BlockSpec:
    """Llama's spec with the gate in q_proj's rows and the partial rotary; the linear
    layers' projections apart (``linear_attention_shapes``), in_proj_qkv and conv1d
    grouped per key head (``fused``)."""
    shapes = dict(llama_spec(args).shapes)
    shapes["q_proj"] = (args.dim, 2 * args.n_heads * args.head_dim)
    # in_proj_qkv's rows and the convolution's channels, grouped per key head in memory
    layout = qkv_layout(args)
    return dataclasses.replace(
        llama_spec(args), shapes=shapes, norm="rms_one_plus", rotary_features=args.rotary_dim,
        head_norms=True, fused={"in_proj_qkv": layout, "conv1d": layout},
        linear_layers=tuple(i for i in range(args.n_layers) if args.is_linear(i)),
        linear_attention_shapes=linear_attention_shapes(args))


def linear_attention_shapes(args) -> dict[str, tuple[int, int]]:
    """A Gated DeltaNet's projections, (in_features, out_features) by name: q and k take
    the key heads' width each, v and the output gate z the value heads'; b and a one
    feature per value head."""
    key_dim = args.linear_key_heads * args.linear_key_head_dim
    value_dim = args.linear_value_heads * args.linear_value_head_dim
    return {"in_proj_qkv": (args.dim, 2 * key_dim + value_dim),
            "in_proj_z": (args.dim, value_dim), "in_proj_b": (args.dim, args.linear_value_heads),
            "in_proj_a": (args.dim, args.linear_value_heads), "out_proj": (value_dim, args.dim)}
