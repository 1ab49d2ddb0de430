"""Hugging Face's Qwen3-Next (``qwen3_next``, ``Qwen3NextForCausalLM``) and Qwen3.5-MoE
(``qwen3_5_moe_text``, ``Qwen3_5MoeForCausalLM``; the Hub's image-text
``Qwen3_5MoeForConditionalGeneration`` directories too, their vision tower kept as
Qwen3.5's, ``models/qwen3_5/vision.py``) <-> lmforge's ``HybridSparse``.

The attention, linear layers and norms read and write as Qwen3.5's (``models/qwen3_5/hf.py``);
the experts' fields and names are added here, Qwen3-MoE's plus the gated shared expert
(``mlp.shared_expert.*``, ``mlp.shared_expert_gate``). What differs between the two model
types is ``VARIANTS``'s: Qwen3-Next's checkpoints fuse each linear layer's input
projections (``in_proj_qkvz``, ``in_proj_ba``: regrouped on load, fused again on export,
``gated_deltanet.from_qwen3_next``), and only Qwen3-Next's config has dense layers and a
choice of renormalising the top-k weights. Both store one tensor per expert, stacked on load
and split on export (``models/moe_hf.py``), as transformers 5 does."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from lmforge.models.gated_deltanet import from_qwen3_next, to_qwen3_next
from lmforge.models.mapping import HFCheckpointError, config_bool, config_float, config_int
from lmforge.models.moe_hf import check_top_k, checkpoint_from_hf, checkpoint_to_hf
from lmforge.models.qwen3_5 import hf as qwen3_5_hf
from lmforge.models.qwen3_5 import vision
from lmforge.models.qwen3_moe.hf import _dense_layers as dense_layers  # transformers' rule
from lmforge.models.qwen3_moe.hf import with_experts
from lmforge.models.qwen3_next.model import FUSED_PROJECTIONS, HybridSparseArgs


@dataclass(frozen=True)
class Variant:
    """What one model_type's config.json and checkpoint files hold."""
    architecture: str
    fused_linear: bool  # in_proj_qkvz and in_proj_ba in the files
    # intermediate_size, mlp_only_layers, decoder_sparse_step and norm_topk_prob in
    # config.json (else: no dense layers, top-k weights always renormalised)
    dense_layer_keys: bool


VARIANTS = {"qwen3_next": Variant("Qwen3NextForCausalLM", True, True),
            "qwen3_5_moe_text": Variant("Qwen3_5MoeForCausalLM", False, False)}
_DEFAULTS = {"norm_topk_prob": True, "router_aux_loss_coef": 0.001}  # transformers'
_MOE_NAMES = {  # an MoE layer's tensors, ours -> Hugging Face's (transformers 5's in memory)
    "feed_forward.gate.weight": "mlp.gate.weight",
    "feed_forward.experts.gate_up_proj": "mlp.experts.gate_up_proj",
    "feed_forward.experts.down_proj": "mlp.experts.down_proj",
    **{f"feed_forward.shared_experts.{p}.weight": f"mlp.shared_expert.{p}.weight"
       for p in ("gate_proj", "up_proj", "down_proj")},
    "feed_forward.shared_expert_gate.weight": "mlp.shared_expert_gate.weight",
}
MTP_PREFIX = "mtp."  # multi-token-prediction layers the released checkpoints hold; not built


def args_from_hf_config(cfg: dict, source: str = "config.json") -> HybridSparseArgs:
    """A transformers Qwen3-Next or Qwen3.5-MoE text config dict -> ``HybridSparseArgs``:
    the hybrid layers as Qwen3.5's reader reads them, then the experts; refused, naming
    the field, whatever our model would compute otherwise."""
    # (a Qwen3_5MoeForConditionalGeneration's language model: its text_config, ``vision``)
    text, image_text = vision.text_config(cfg, source)
    where = f"{source}: text_config" if image_text else source
    model_type = text.get("model_type", "qwen3_next")
    variant = VARIANTS[model_type]
    expert_width = config_int(text, "moe_intermediate_size", where)
    if not variant.dense_layer_keys:  # no dense layers: ffn_dim is an expert's (Mixtral's way)
        text = {**text, "intermediate_size": expert_width}
    base = qwen3_5_hf.args_from_hf_config(cfg | {"text_config": text} if image_text else text,
                                          source)
    n_experts = config_int(text, "num_experts", where)
    top_k = config_int(text, "num_experts_per_tok", where)
    check_top_k(top_k, n_experts, where)
    cfg, source = text, where
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    dense = variant.dense_layer_keys
    return HybridSparseArgs(
        **fields | {"family": model_type}, n_experts=n_experts, top_k=top_k,
        moe_ffn_dim=expert_width,
        shared_ffn_dim=config_int(cfg, "shared_expert_intermediate_size", source),
        norm_topk_prob=config_bool(cfg, "norm_topk_prob", source,
                                   _DEFAULTS["norm_topk_prob"]) if dense else True,
        dense_layers=dense_layers(cfg, base.n_layers, source) if dense else (),
        router_aux_loss_coef=config_float(cfg, "router_aux_loss_coef", source,
                                          _DEFAULTS["router_aux_loss_coef"], positive=False))


def hf_config_from_args(args: HybridSparseArgs) -> dict:
    """``HybridSparseArgs`` -> a config.json dict that transformers 5 loads (an image-text
    source's own config with these as its text_config: ``vision.conditional_config``)."""
    variant = VARIANTS[args.family]
    cfg = qwen3_5_hf.hf_config_from_args(dataclasses.replace(args, vision_from=None)) | {
        "architectures": [variant.architecture], "model_type": args.family,
        "num_experts": args.n_experts, "num_experts_per_tok": args.top_k,
        "moe_intermediate_size": args.moe_ffn_dim,
        "shared_expert_intermediate_size": args.shared_ffn_dim,
        "router_aux_loss_coef": args.router_aux_loss_coef, "output_router_logits": False}
    if variant.dense_layer_keys:
        cfg |= {"norm_topk_prob": args.norm_topk_prob, "decoder_sparse_step": 1,
                "mlp_only_layers": list(args.dense_layers)}
    else:
        del cfg["intermediate_size"]  # (Qwen3.5-MoE's config has none)
    if args.vision_from is not None:  # (the image-text model's own, written back)
        del cfg["architectures"], cfg["torch_dtype"]
    return vision.conditional_config(args, cfg)


def hf_names(args: HybridSparseArgs) -> dict[str, str]:
    """Our parameter name -> HF name (transformers 5's in-memory names: the checkpoint
    files' fused projections and per-expert tensors are ``checkpoint_in``'s and
    ``checkpoint_out``'s)."""
    text_only = dataclasses.replace(args, vision_from=None)
    names = with_experts(qwen3_5_hf.hf_names(text_only), args, _MOE_NAMES)
    return {ours: vision.hf_name(theirs, args) for ours, theirs in names.items()}


def checkpoint_in(sd: dict, args: HybridSparseArgs, source: str) -> dict:
    """A checkpoint's tensors in ``hf_names``' names: the multi-token-prediction layers
    dropped (as transformers does), Qwen3-Next's fused projections split (each checked
    first, so that a missing one is named as the file has it), the experts stacked."""
    sd = {k: v for k, v in vision.drop_vision(sd, args).items() if not k.startswith(MTP_PREFIX)}
    if VARIANTS[args.family].fused_linear:
        _check_fused(sd, args, source)
        sd = from_qwen3_next(sd, args)
    return checkpoint_from_hf(sd, "per_expert", args.n_experts, source)


def checkpoint_out(sd: dict, args: HybridSparseArgs) -> dict:
    """``checkpoint_in``'s inverse: the released checkpoints' (and ``save_pretrained``'s)
    per-expert tensors and, for Qwen3-Next, fused projections."""
    sd = checkpoint_to_hf(sd, "per_expert")
    sd = to_qwen3_next(sd, args) if VARIANTS[args.family].fused_linear else sd
    return vision.add_vision(sd, args)


def _check_fused(sd: dict, args: HybridSparseArgs, source: str) -> None:
    """Each linear layer's two fused projections present, with the rows its heads need."""
    key_dim = args.linear_key_heads * args.linear_key_head_dim
    value_dim = args.linear_value_heads * args.linear_value_head_dim
    rows = {"in_proj_qkvz": 2 * key_dim + 2 * value_dim,  # q, k, v, z
            "in_proj_ba": 2 * args.linear_value_heads}  # b, a: one each per value head
    for i in (i for i in range(args.n_layers) if args.is_linear(i)):
        for name in FUSED_PROJECTIONS.fused_in_files:
            key = f"model.layers.{i}.linear_attn.{name}.weight"
            if key not in sd:
                raise HFCheckpointError(f"{source}: missing: {key}")
            if tuple(sd[key].shape) != (rows[name], args.dim):
                raise HFCheckpointError(f"{source}: misshaped: {key} {tuple(sd[key].shape)} "
                                        f"(expected {(rows[name], args.dim)})")
