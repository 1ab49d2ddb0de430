"""Qwen3-Next (transformers' ``qwen3_next``) and Qwen3.5-MoE (``qwen3_5_moe_text``, whose
folder builds this model): Qwen3.5's hybrid of Gated DeltaNet and gated full-attention
layers (``models/qwen3_5``: zero-centred norms, partial rotary, the output gate in q_proj's
rows) with Qwen3-MoE's mixture of experts as the feed-forward (``models/moe.py``: a softmax
router, top-k weights renormalised as ``norm_topk_prob`` says), plus one always-on shared
expert whose output each token scales by sigmoid(shared_expert_gate(x)) (transformers'
``Qwen3NextSparseMoeBlock``). Every layer is sparse unless ``dense_layers`` names it
(Qwen3-Next's ``mlp_only_layers`` and ``decoder_sparse_step``; Qwen3.5-MoE has none).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import nn

from lmforge.models.family import BlockSpec
from lmforge.models.llama.model import FeedForward
from lmforge.models.moe import MoE, MoEArgs
from lmforge.models.qwen3_5 import model as qwen3_5
from lmforge.models.qwen3_5.model import Hybrid, HybridArgs, HybridBlock
from lmforge.models.qwen3_moe import model as qwen3_moe
from lmforge.models.qwen3_moe.model import SparseArgs

# Qwen3.5's linear layers, and Qwen3-MoE's stacked experts beside them (Qwen3.5-MoE's).
PROJECTIONS = dataclasses.replace(qwen3_5.PROJECTIONS, experts=qwen3_moe.PROJECTIONS.experts,
                                  experts_for=qwen3_moe.PROJECTIONS.experts_for)
# Qwen3-Next's: its files (and transformers' model) fuse each Gated DeltaNet's input
# projections per key head, in_proj_qkvz and in_proj_ba, where we keep Qwen3.5's apart
# (``gated_deltanet.from_qwen3_next``); LoRA on the parts crosses to peft as one adapter
# on the fused layer, and the names peft's users write for them mean both parts.
FUSED_PROJECTIONS = dataclasses.replace(
    PROJECTIONS, fused_in_files={"in_proj_qkvz": ("in_proj_qkv", "in_proj_z"),
                                 "in_proj_ba": ("in_proj_b", "in_proj_a")})


@dataclass(frozen=True)
class HybridSparseArgs(HybridArgs, SparseArgs):
    """Qwen3.5's fields (``layer_types``, the linear layers' shape), Qwen3-MoE's (the
    experts, ``dense_layers``; ``ffn_dim``: the dense layers' width) and the shared
    expert's width. Defaults: Qwen3-Next-80B-A3B's."""
    family: str = "qwen3_next"  # HF model_type: qwen3_next | qwen3_5_moe_text
    n_experts: int = 512  # num_experts
    top_k: int = 10  # num_experts_per_tok
    moe_ffn_dim: int = 512  # moe_intermediate_size
    shared_ffn_dim: int = 512  # shared_expert_intermediate_size

    @property
    def moe(self) -> MoEArgs:
        return dataclasses.replace(super().moe, n_shared_experts=1,
                                   shared_ffn_dim=self.shared_ffn_dim, shared_expert_gate=True)

    @classmethod
    def from_dict(cls, recorded: dict) -> "HybridSparseArgs":
        """The inverse of ``dataclasses.asdict`` (JSON turns the tuples into lists)."""
        base = HybridArgs.from_dict.__func__(cls, recorded)
        return dataclasses.replace(base, dense_layers=tuple(recorded.get("dense_layers", ())))


class HybridSparseBlock(HybridBlock):
    """Qwen3.5's block whose feed-forward is an ``MoE`` unless the layer is dense."""

    @staticmethod
    def feed_forward_of(args: HybridSparseArgs, layer_id: int) -> nn.Module:
        return FeedForward(args) if layer_id in args.dense_layers else MoE(args.moe)


class HybridSparse(Hybrid):
    """Qwen3.5's stack of ``HybridSparseBlock``s."""
    block_class = HybridSparseBlock


def block_spec(args: HybridSparseArgs) -> BlockSpec:
    """Qwen3.5's spec (the dense layers' MLP is ``shapes``'), with the experts."""
    return dataclasses.replace(qwen3_5.block_spec(args), moe=args.moe,
                               sparse_layers=args.sparse_layers)
