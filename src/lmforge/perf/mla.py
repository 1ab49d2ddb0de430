"""Multi-head latent attention (DeepSeek-V3, ``models/mla.py``) in the performance model
(docs/estimate.md, "Multi-head latent attention"): its shape and its FLOPs per token;
``perf/mla_walk.py`` walks what it keeps for backward.

    x -> q_a_proj -> q_a_layernorm -> q_b_proj -> q (h x (nope + rope))  (or q_proj)
    x -> kv_a_proj_with_mqa -> [latent (kv_lora_rank) | k_rope (rope, shared by heads)]
         latent -> kv_a_layernorm -> kv_b_proj -> [k_nope (h x nope) | v (h x v_head_dim)]
    q, k = cat(nope, rotated rope); attention over qk = nope + rope; o_proj(h x v)

An MLA is recognised by the fields ``models.mla.MLAArgs`` names (``kv_lora_rank`` and the
head sizes), which its attention reads from any args object."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

KV_A, KV_B, OUT = "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"


@dataclass(frozen=True)
class LatentAttention:
    """MLA's sizes: heads, the two latents (q_lora_rank None: a plain q_proj) and the
    head dims of the key without and with position, and of the value."""
    n_heads: int
    q_lora_rank: Optional[int]
    kv_lora_rank: int
    nope: int
    rope: int
    v: int

    @property
    def qk(self) -> int:
        return self.nope + self.rope

    @property
    def inputs(self) -> tuple[str, ...]:
        """The projections that read the block's normalised input."""
        return ("q_proj" if self.q_lora_rank is None else "q_a_proj", KV_A)

    @property
    def latent_norm_params(self) -> int:
        """q_a_layernorm's and kv_a_layernorm's weights."""
        return (self.q_lora_rank or 0) + self.kv_lora_rank


def latent_attention(args: Any) -> Optional[LatentAttention]:
    """The MLA described by ``args``, or None for every other attention."""
    if getattr(args, "kv_lora_rank", None) is None:
        return None
    return LatentAttention(args.n_heads, args.q_lora_rank, args.kv_lora_rank,
                           args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim)


# -------------------------------------------------------------------------- FLOPs

def mla_flops(fl: Any, mla: LatentAttention, linear: Callable[[str, bool], bool],
              norms: bool, rg_in: bool, keys: float) -> bool:
    """Adds one MLA's FLOPs per token to ``fl`` (a ``FlopsBreakdown``): its projections
    through ``linear(name, input requires grad) -> output requires grad``, and the score
    (qk head dim) and value (v head dim) products over ``keys`` keys per query; whether
    its output requires grad. ``norms``: the latent norms' weights train."""
    if mla.q_lora_rank is None:
        q = linear("q_proj", rg_in)
    else:
        q = linear("q_b_proj", linear("q_a_proj", rg_in) or norms)
    latent = linear(KV_A, rg_in)  # also the rotary key, shared by the heads
    kv = linear(KV_B, latent or norms)
    k, v = kv or latent, kv
    score, value = 2 * keys * mla.n_heads * mla.qk, 2 * keys * mla.n_heads * mla.v
    fl.attention_forward += score + value
    # dP = dO V^T and dV = P^T dO over v; dQ = dS K and dK = dS^T Q over qk
    fl.attention_backward += value * ((q or k) + v) + score * (q + k)
    return linear(OUT, q or k or v)
