"""gpt-oss (OpenAI's open-weight mixture of experts, 2025).

Against Llama: q, k, v and o all have biases; heads are sized apart from dim (64); each
head has a learned sink, a logit that joins the softmax's denominator with no value, so a
query may attend to nothing (``attend``'s ``sinks``); the layers alternate a sliding
window (128 keys) with global attention; RoPE is YaRN's; the MLP is a mixture of experts
(``models/moe.py``) whose router has a bias and takes the top k logits before the
softmax, and whose experts have biases and a clamped SwiGLU.

The blocks keep Llama's names (``attention``, ``feed_forward``, the two norms); the
``feed_forward`` is an ``MoE`` whose last ``Routing`` the trainer reads
(``moe.routings``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from lmforge.models.attention import attend, per_forward
from lmforge.models.common import DecoderStack, KVCache, PreNormBlock, Projections
from lmforge.models.family import BlockSpec
from lmforge.models.llama.model import RMSNorm, RopeScaling, apply_rope, rope_cos_sin
from lmforge.models.moe import MoE, MoEArgs

# The attention's projections; the MLP has no linear layers of its own: the experts'
# stacked weights are parameters of the MoE block.
PROJECTIONS = Projections(
    attention=("q_proj", "k_proj", "v_proj", "o_proj"), mlp=(),
    aliases={"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"},
    lora_default=("q_proj", "v_proj"),
    experts=("experts.gate_up_proj", "experts.down_proj"),
    experts_for={"gate_proj": "experts.gate_up_proj", "up_proj": "experts.gate_up_proj",
                 "gate_up_proj": "experts.gate_up_proj", "down_proj": "experts.down_proj"})

SLIDING, GLOBAL = "sliding", "global"


@dataclass(frozen=True)
class GptOssArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ffn_dim: int  # an expert's width (intermediate_size)
    explicit_head_dim: int = 64  # heads are sized apart from dim (2880 / 64 heads)
    max_seq_len: int = 131072
    rope_theta: float = 150000.0
    rope_scaling: Optional[RopeScaling] = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    family: str = "gpt_oss"
    n_experts: int = 32  # num_local_experts
    top_k: int = 4  # num_experts_per_tok
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    router_aux_loss_coef: float = 0.001  # the load-balancing loss's weight in training
    sliding_window: int = 128
    layer_types: Optional[tuple[str, ...]] = None  # per layer; None: sliding, global, ...

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim

    @property
    def attention_kinds(self) -> tuple[str, ...]:
        if self.layer_types is not None:
            return self.layer_types
        return tuple(SLIDING if i % 2 == 0 else GLOBAL for i in range(self.n_layers))

    @property
    def moe(self) -> MoEArgs:
        return MoEArgs(dim=self.dim, n_experts=self.n_experts, top_k=self.top_k,
                       ffn_dim=self.ffn_dim, router="topk_softmax", router_bias=True,
                       activation="clamped_swiglu", expert_bias=True,
                       swiglu_alpha=self.swiglu_alpha, swiglu_limit=self.swiglu_limit)

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        return tuple(range(self.n_layers))  # every layer's MLP is the experts

    @classmethod
    def from_dict(cls, recorded: dict) -> "GptOssArgs":
        """The inverse of ``dataclasses.asdict`` (JSON turns tuples into lists)."""
        scaling, kinds = recorded.get("rope_scaling"), recorded.get("layer_types")
        return cls(**{**recorded, "rope_scaling": RopeScaling(**scaling) if scaling else None,
                      "layer_types": tuple(kinds) if kinds else None})


class Attention(nn.Module):
    """Grouped-query attention with biases everywhere and a sink per head."""

    def __init__(self, args: GptOssArgs, sliding: bool):
        super().__init__()
        self.args, self.head_dim = args, args.head_dim
        self.window = args.sliding_window if sliding else None
        hd = args.head_dim
        self.q_proj = nn.Linear(args.dim, args.n_heads * hd)
        self.k_proj = nn.Linear(args.dim, args.n_kv_heads * hd)
        self.v_proj = nn.Linear(args.dim, args.n_kv_heads * hd)
        self.o_proj = nn.Linear(args.n_heads * hd, args.dim)
        self.sinks = nn.Parameter(torch.empty(args.n_heads))

    def forward(self, x, positions=None, mask=None, cache: Optional[KVCache] = None):
        batch, seq, _ = x.shape
        past = cache.length if cache is not None else 0
        if positions is None:
            positions = torch.arange(past, past + seq, device=x.device).expand(batch, seq)
        cos, sin = per_forward(mask, "rope",  # (batch, seq, head_dim) each
                               lambda: rope_cos_sin(self.args, positions))
        q = self.q_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)  # (b, h, s, hd)
        k = self.k_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)  # (b, kv, s, hd)
        v = self.v_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)  # (b, kv, s, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.append(k, v)  # (b, kv, past + s, hd)
        # (tensor parallelism splits the sinks as the heads: this rank's, as a tensor)
        sinks = self.sinks.to_local() if hasattr(self.sinks, "to_local") else self.sinks
        out = attend(q, k, v, mask, past=past, window=self.window,
                     sinks=sinks)  # (b, h, s, hd)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))

    def reset_parameters(self, std: float, out_std: float) -> None:
        for proj, s in ((self.q_proj, std), (self.k_proj, std), (self.v_proj, std),
                        (self.o_proj, out_std)):
            nn.init.trunc_normal_(proj.weight, std=s, a=-3 * s, b=3 * s)
            nn.init.zeros_(proj.bias)
        nn.init.normal_(self.sinks, std=std)  # as the reference initialises them


class GptOssBlock(PreNormBlock):
    """Pre-norm attention, then the mixture of experts."""

    def __init__(self, args: GptOssArgs, layer_id: int):
        super().__init__(layer_id, RMSNorm(args.dim, args.norm_eps),
                         Attention(args, args.attention_kinds[layer_id] == SLIDING),
                         RMSNorm(args.dim, args.norm_eps), MoE(args.moe))


class GptOss(DecoderStack):
    def __init__(self, args: GptOssArgs):
        super().__init__(args, GptOssBlock, RMSNorm(args.dim, args.norm_eps), output_bias=False)


def expert_shapes(args: GptOssArgs) -> dict[str, tuple[int, ...]]:
    """One layer's stacked expert weights as transformers holds them in memory (and the
    MXFP4 blocks dequantize to): name -> (experts, in, out)."""
    e, d, f = args.n_experts, args.dim, args.ffn_dim
    return {"gate_up_proj": (e, d, 2 * f), "down_proj": (e, f, d)}


def block_spec(args: GptOssArgs) -> BlockSpec:
    """The attention's projections (biased), per-layer windows and the experts."""
    d, hd = args.dim, args.head_dim
    shapes = {"q_proj": (d, args.n_heads * hd), "k_proj": (d, args.n_kv_heads * hd),
              "v_proj": (d, args.n_kv_heads * hd), "o_proj": (args.n_heads * hd, d)}
    return BlockSpec(shapes=shapes, biased=tuple(shapes), rotary_features=hd,
                     attention=args.attention_kinds, sliding_window=args.sliding_window,
                     moe=args.moe, sparse_layers=args.sparse_layers)


__all__ = ["GptOss", "GptOssArgs", "GptOssBlock", "PROJECTIONS", "block_spec",
           "expert_shapes"]
