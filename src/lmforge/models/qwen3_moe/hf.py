"""Hugging Face's Qwen3-MoE and Mixtral <-> lmforge's ``SparseLlama``: config.json
fields and parameter names. The attention and the dense layers read and write as Qwen3's
and Mistral's (``models/llama/hf.py``, whose variants they are); the experts' fields are
added here, and the checkpoint files' per-expert tensors are stacked on load and split on
export (``models/moe_hf.py``), as transformers 5 does."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from lmforge.models.llama import hf as llama_hf
from lmforge.models.mapping import (HFCheckpointError, config_bool, config_float,
                                    config_int)
from lmforge.models.moe_hf import check_top_k, checkpoint_from_hf, checkpoint_to_hf
from lmforge.models.qwen3_moe.model import SparseArgs

rope_scaling_from = llama_hf.rope_scaling_from


@dataclass(frozen=True)
class Experts:
    """Where one model_type's config.json keeps its experts' fields."""
    count: tuple[str, ...]  # the expert count's key as transformers 5 writes it, and aliases
    width: str  # an expert's width
    norm_topk_prob: bool | None  # fixed (Mixtral renormalises always), None: config.json's
    dense_layer_keys: bool  # mlp_only_layers / decoder_sparse_step


EXPERTS = {
    "qwen3_moe": Experts(("num_local_experts", "num_experts"), "moe_intermediate_size",
                         None, True),
    "mixtral": Experts(("num_local_experts",), "intermediate_size", True, False),
}
# transformers' defaults for the fields a config may omit
_DEFAULTS = {"norm_topk_prob": False, "decoder_sparse_step": 1, "router_aux_loss_coef": 0.001}
_LAYER_NAMES = {  # an MoE layer's tensors, ours -> Hugging Face's (in transformers 5's form)
    "feed_forward.gate.weight": "mlp.gate.weight",
    "feed_forward.experts.gate_up_proj": "mlp.experts.gate_up_proj",
    "feed_forward.experts.down_proj": "mlp.experts.down_proj",
}
_DENSE = ("gate_proj", "up_proj", "down_proj")


def args_from_hf_config(cfg: dict, source: str = "config.json") -> SparseArgs:
    """A transformers Qwen3-MoE or Mixtral config dict -> ``SparseArgs``: the attention as
    the Llama variant reads it, then the experts; refused, naming the field, whatever our
    model would compute otherwise."""
    base = llama_hf.args_from_hf_config(cfg, source)
    experts = EXPERTS[base.family]
    if cfg.get("router_jitter_noise"):
        raise HFCheckpointError(f"{source}: router_jitter_noise = "
                                f"{cfg['router_jitter_noise']!r} is not supported (lmforge "
                                f"routes without noise)")
    n_experts = config_int(cfg, experts.count, source)
    top_k = config_int(cfg, "num_experts_per_tok", source)
    check_top_k(top_k, n_experts, source, next(k for k in experts.count if k in cfg))
    norm = experts.norm_topk_prob
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    return SparseArgs(
        **fields, n_experts=n_experts, top_k=top_k,
        moe_ffn_dim=config_int(cfg, experts.width, source),
        norm_topk_prob=norm if norm is not None else config_bool(
            cfg, "norm_topk_prob", source, _DEFAULTS["norm_topk_prob"]),
        dense_layers=_dense_layers(cfg, base.n_layers, source) if experts.dense_layer_keys
        else (),
        router_aux_loss_coef=config_float(cfg, "router_aux_loss_coef", source,
                                          _DEFAULTS["router_aux_loss_coef"], positive=False))


def _dense_layers(cfg: dict, n_layers: int, source: str) -> tuple[int, ...]:
    """transformers' rule: layer i is sparse unless listed in ``mlp_only_layers`` or
    (i + 1) is not a multiple of ``decoder_sparse_step``."""
    step = config_int(cfg, "decoder_sparse_step", source, _DEFAULTS["decoder_sparse_step"])
    listed = cfg.get("mlp_only_layers") or []
    if not isinstance(listed, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n_layers
            for i in listed):
        raise HFCheckpointError(f"{source}: mlp_only_layers: {listed!r} is not a list of "
                                f"layer indices below num_hidden_layers ({n_layers})")
    return tuple(i for i in range(n_layers) if i in listed or (i + 1) % step)


def hf_config_from_args(args: SparseArgs) -> dict:
    """``SparseArgs`` -> a config.json dict that transformers 5 loads."""
    cfg = llama_hf.hf_config_from_args(args)
    experts = EXPERTS[args.family]
    cfg |= {experts.count[0]: args.n_experts, "num_experts_per_tok": args.top_k,
            experts.width: args.moe_ffn_dim, "router_aux_loss_coef": args.router_aux_loss_coef,
            "output_router_logits": False}
    if experts.norm_topk_prob is None:
        cfg["norm_topk_prob"] = args.norm_topk_prob
    if experts.dense_layer_keys:
        cfg |= {"decoder_sparse_step": 1, "mlp_only_layers": list(args.dense_layers)}
    return cfg


def hf_names(args: SparseArgs) -> dict[str, str]:
    """Our parameter name -> HF name (transformers 5's in-memory names: the checkpoint
    files' per-expert tensors are ``checkpoint_in``'s and ``checkpoint_out``'s)."""
    return with_experts(llama_hf.hf_names(args), args)


def with_experts(names: dict[str, str], args, layer_names: dict = _LAYER_NAMES) -> dict:
    """``names`` (a dense stack's) with each sparse layer's MLP names replaced by its
    MoE's, ``layer_names`` (ours -> HF's within a layer; Qwen3-Next's add the gated
    shared expert)."""
    names = dict(names)
    for i in args.sparse_layers:
        for proj in _DENSE:
            del names[f"layers.{i}.feed_forward.{proj}.weight"]
        names |= {f"layers.{i}.{ours}": f"model.layers.{i}.{theirs}"
                  for ours, theirs in layer_names.items()}
    return names


def checkpoint_in(sd: dict, args: SparseArgs, source: str) -> dict:
    """A checkpoint's tensors with each layer's per-expert weights stacked."""
    return checkpoint_from_hf(sd, "per_expert", args.n_experts, source)


def checkpoint_out(sd: dict, args: SparseArgs) -> dict:
    """The stacked expert weights split per expert, as the released checkpoints (and
    transformers' ``save_pretrained``) store them."""
    return checkpoint_to_hf(sd, "per_expert")
