"""Qwen3-MoE: Qwen3's attention (q/k norms, an explicit head_dim) with a mixture of
experts in place of the MLP (``models/moe.py``), and dense MLPs on the layers
``dense_layers`` names (transformers' ``mlp_only_layers`` and ``decoder_sparse_step``).
Mixtral is the same block with Mistral's attention (its folder builds this model).

The blocks keep Llama's names (``attention``, ``feed_forward``, the two norms); an MoE
layer's ``feed_forward`` is an ``MoE`` whose last ``Routing`` the trainer reads for the
load-balancing loss and the expert load (``moe.take_routings``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from lmforge.models.common import PreNormBlock, Projections
from lmforge.models.family import BlockSpec
from lmforge.models.llama.model import (Attention, FeedForward, Llama, LlamaArgs, RMSNorm,
                                        block_spec as llama_block_spec)
from lmforge.models.moe import MoE, MoEArgs

# The attention's and the dense layers' projections are Llama's; the experts' stacked
# weights are parameters of the MoE block, not linear layers (``peft.expert_lora``).
PROJECTIONS = Projections(
    attention=("q_proj", "k_proj", "v_proj", "o_proj"),
    mlp=("gate_proj", "up_proj", "down_proj"),
    aliases={"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
             "gate": "gate_proj", "up": "up_proj", "down": "down_proj"},
    lora_default=("q_proj", "v_proj"),
    experts=("experts.gate_up_proj", "experts.down_proj"),
    experts_for={"gate_proj": "experts.gate_up_proj", "up_proj": "experts.gate_up_proj",
                 "gate_up_proj": "experts.gate_up_proj", "down_proj": "experts.down_proj"})


@dataclass(frozen=True)
class SparseArgs(LlamaArgs):
    """Llama's fields (``ffn_dim``: the dense layers' width) and the experts'."""
    family: str = "qwen3_moe"  # HF model_type: qwen3_moe | mixtral
    n_experts: int = 8  # num_experts / num_local_experts
    top_k: int = 2  # num_experts_per_tok
    moe_ffn_dim: int = 0  # an expert's width: moe_intermediate_size (Mixtral: intermediate_size)
    norm_topk_prob: bool = True  # the k chosen weights rescaled to sum to 1
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP of width ffn_dim
    router_aux_loss_coef: float = 0.001  # the load-balancing loss's weight in training

    @property
    def moe(self) -> MoEArgs:
        return MoEArgs(dim=self.dim, n_experts=self.n_experts, top_k=self.top_k,
                       ffn_dim=self.moe_ffn_dim, norm_topk_prob=self.norm_topk_prob)

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.n_layers) if i not in self.dense_layers)

    @classmethod
    def from_dict(cls, recorded: dict) -> "SparseArgs":
        """The inverse of ``dataclasses.asdict`` (JSON turns the tuple into a list)."""
        base = LlamaArgs.from_dict.__func__(cls, recorded)
        return dataclasses.replace(base, dense_layers=tuple(recorded.get("dense_layers", ())))


class SparseBlock(PreNormBlock):
    """Llama's block whose feed-forward is an ``MoE`` unless the layer is dense."""

    def __init__(self, args: SparseArgs, layer_id: int):
        sparse = layer_id not in args.dense_layers
        super().__init__(layer_id, RMSNorm(args.dim, args.norm_eps), Attention(args),
                         RMSNorm(args.dim, args.norm_eps),
                         MoE(args.moe) if sparse else FeedForward(args))


class SparseLlama(Llama):
    """Llama's stack (its top level and initialisation) of ``SparseBlock``s."""
    block_class = SparseBlock


def block_spec(args: SparseArgs) -> BlockSpec:
    """Llama's spec (attention and the dense layers' MLP), with the experts."""
    return dataclasses.replace(llama_block_spec(args), moe=args.moe,
                               sparse_layers=args.sparse_layers)
