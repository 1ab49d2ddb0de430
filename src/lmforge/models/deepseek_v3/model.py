"""DeepSeek-V3 (and Moonlight, the same architecture at 16B): multi-head latent attention
(``models/mla.py``) and a mixture of experts (``models/moe.py``: sigmoid scores, a
group-limited top-k, a correction bias that steers the choice, shared experts) in every
layer but the first ``first_k_dense``, which keep a dense SwiGLU MLP.

    h   = x + MLA(RMSNorm(x))
    out = h + MLP(RMSNorm(h))     MLP: dense (layer < first_k_dense) or MoE

The blocks keep the names every family's blocks have (``attention``, ``feed_forward``,
``attention_norm``, ``ffn_norm``); inside them the leaf names are transformers' own. An
MoE layer's ``feed_forward`` returns (output, ``Routing``) and keeps the last ``Routing``
for the trainer (``moe.take_routings``), as Qwen3-MoE's does. The paper's multi-token
prediction module is a training extra that is not built (``hf.py`` says how its tensors
are treated).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torch import nn

from lmforge.models.common import DecoderStack, GatedMLP, PreNormBlock, Projections
from lmforge.models.family import BlockSpec
from lmforge.models.llama.model import RMSNorm
from lmforge.models.mla import MLAttention, YarnScaling
from lmforge.models.moe import MoE, MoEArgs

# The attention's linear layers in model order (a model has q_proj, or q_a_proj and
# q_b_proj, as q_lora_rank says); the MLP's are the dense layers' and the shared experts'.
# The routed experts' stacked weights are parameters of the MoE block, not linear layers.
PROJECTIONS = Projections(
    attention=("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"),
    mlp=("gate_proj", "up_proj", "down_proj"),
    # DeepSeek's reference code names them wq, wq_a, wq_b, wkv_a, wkv_b, wo, w1, w3, w2.
    aliases={"wq": "q_proj", "wq_a": "q_a_proj", "wq_b": "q_b_proj",
             "wkv_a": "kv_a_proj_with_mqa", "wkv_b": "kv_b_proj", "wo": "o_proj",
             "o": "o_proj", "w1": "gate_proj", "gate": "gate_proj", "w3": "up_proj",
             "up": "up_proj", "w2": "down_proj", "down": "down_proj"},
    # peft has no default for deepseek_v3; ours is every projection that makes queries,
    # keys and values (each model has the ones its q_lora_rank gives it).
    lora_default=("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"),
    # The MLP names mean the routed experts, as peft reads them on transformers 5's
    # DeepSeek-V3 (peft.targets): the dense layers' and shared experts' MLPs take none.
    experts=("experts.gate_up_proj", "experts.down_proj"),
    experts_for={"gate_proj": "experts.gate_up_proj", "up_proj": "experts.gate_up_proj",
                 "gate_up_proj": "experts.gate_up_proj", "down_proj": "experts.down_proj"})


@dataclass(frozen=True)
class DeepseekV3Args:
    """The shape fields every family has, then MLA's and the experts'. The comments give
    the config.json field each reads."""
    dim: int  # hidden_size
    n_layers: int  # num_hidden_layers
    n_heads: int  # num_attention_heads
    n_kv_heads: int  # num_key_value_heads: MLA gives every head its key, so = n_heads
    vocab_size: int
    ffn_dim: int  # intermediate_size: the dense layers' width
    max_seq_len: int = 4096  # max_position_embeddings
    rope_theta: float = 10000.0
    rope_scaling: Optional[YarnScaling] = None  # rope_type yarn, with DeepSeek's mscales
    norm_eps: float = 1e-6  # rms_norm_eps (the latent norms: mla.LATENT_NORM_EPS)
    tie_embeddings: bool = False
    init_std: float = 0.02
    family: str = "deepseek_v3"
    # multi-head latent attention
    q_lora_rank: Optional[int] = 1536  # None: a plain q_proj (Moonlight)
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_interleave: bool = True
    attention_bias: bool = False
    # the mixture of experts
    n_experts: int = 256  # n_routed_experts
    top_k: int = 8  # num_experts_per_tok
    moe_ffn_dim: int = 2048  # moe_intermediate_size
    n_shared_experts: int = 1
    n_groups: int = 8  # n_group
    topk_groups: int = 4  # topk_group
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    first_k_dense: int = 3  # first_k_dense_replace: the first layers' MLP is dense
    # num_nextn_predict_layers: multi-token-prediction layers the checkpoint may hold
    # after the last layer; not built (their tensors are dropped on load, hf.py).
    mtp_layers: int = 0

    @property
    def head_dim(self) -> int:
        """A key's width, what the KV cache holds per head (values: ``v_head_dim``)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def moe(self) -> MoEArgs:
        return MoEArgs(dim=self.dim, n_experts=self.n_experts, top_k=self.top_k,
                       ffn_dim=self.moe_ffn_dim, router="sigmoid_group_topk",
                       norm_topk_prob=self.norm_topk_prob, n_groups=self.n_groups,
                       topk_groups=self.topk_groups,
                       routed_scaling_factor=self.routed_scaling_factor,
                       n_shared_experts=self.n_shared_experts)

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        return tuple(range(self.first_k_dense, self.n_layers))

    @classmethod
    def from_dict(cls, recorded: dict) -> "DeepseekV3Args":
        """The inverse of ``dataclasses.asdict`` (JSON turns tuples into lists)."""
        scaling = recorded.get("rope_scaling")
        fields = {k: tuple(v) if isinstance(v, list) else v for k, v in recorded.items()}
        return cls(**{**fields, "rope_scaling": YarnScaling(**scaling) if scaling else None})


class DeepseekV3Block(PreNormBlock):
    def __init__(self, args: DeepseekV3Args, layer_id: int):
        sparse = layer_id >= args.first_k_dense
        super().__init__(layer_id, RMSNorm(args.dim, args.norm_eps), MLAttention(args),
                         RMSNorm(args.dim, args.norm_eps),
                         MoE(args.moe) if sparse else GatedMLP(args.dim, args.ffn_dim, "silu"))


class DeepseekV3(DecoderStack):
    def __init__(self, args: DeepseekV3Args):
        super().__init__(args, DeepseekV3Block, RMSNorm(args.dim, args.norm_eps),
                         output_bias=False)

    def _apply(self, fn, recurse=True):
        """As ``nn.Module``'s (``to``, ``to_empty``, ...), except that the routers'
        correction biases stay fp32 when the model is cast, as transformers keeps them
        and the released checkpoints store them: bf16 would round a checkpoint's values
        and ``update_correction_bias``'s 0.001 steps away. They still move devices."""
        before = {name: b for name, b in self.named_buffers()
                  if name.endswith("e_score_correction_bias")}
        super()._apply(fn, recurse)
        for name, kept in before.items():
            router = self.get_submodule(name.rpartition(".")[0])
            if router.e_score_correction_bias.dtype != kept.dtype:
                router.e_score_correction_bias = kept.to(router.e_score_correction_bias.device)
        return self


def attention_shapes(args: DeepseekV3Args) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of the attention's linear layers, in model order."""
    d, h = args.dim, args.n_heads
    if args.q_lora_rank is None:
        queries = {"q_proj": (d, h * args.head_dim)}
    else:
        queries = {"q_a_proj": (d, args.q_lora_rank),
                   "q_b_proj": (args.q_lora_rank, h * args.head_dim)}
    return queries | {
        "kv_a_proj_with_mqa": (d, args.kv_lora_rank + args.qk_rope_head_dim),
        "kv_b_proj": (args.kv_lora_rank, h * (args.qk_nope_head_dim + args.v_head_dim)),
        "o_proj": (h * args.v_head_dim, d)}


def block_spec(args: DeepseekV3Args) -> BlockSpec:
    """The attention's projections and the dense layers' MLP (the shared experts' linears
    share its leaf names at width n_shared_experts * moe_ffn_dim), and the experts."""
    f = args.ffn_dim
    biased = (tuple(p for p in ("q_a_proj", "kv_a_proj_with_mqa", "o_proj")
                    if p in attention_shapes(args)) if args.attention_bias else ())
    return BlockSpec(
        shapes=attention_shapes(args) | {"gate_proj": (args.dim, f), "up_proj": (args.dim, f),
                                         "down_proj": (f, args.dim)},
        biased=biased, rotary_features=args.qk_rope_head_dim,
        attention=("global",) * args.n_layers, moe=args.moe, sparse_layers=args.sparse_layers)
