"""Hugging Face's gpt-oss (``model_type`` gpt_oss) <-> lmforge's ``GptOss``: config.json
fields and parameter names. transformers' ``save_pretrained`` writes the experts as it
holds them (``mlp.router``, ``mlp.experts.gate_up_proj`` (experts, dim, 2 ffn) with gate
and up interleaved, ...), which ``models/moe_hf.py``'s "gpt_oss" layout maps to the MoE
block on load and back on export; the released checkpoints hold the expert weights in
MXFP4 (``_blocks`` / ``_scales``), dequantized on load (``models/mxfp4.py``). An export
writes them plain, so its config.json has no ``quantization_config``."""
from __future__ import annotations

from typing import Optional

import torch

from lmforge.models.gpt_oss.model import GLOBAL, SLIDING, GptOssArgs, expert_shapes
from lmforge.models.llama.hf import rope_scaling_dict, rope_scaling_from
from lmforge.models.llama.model import RopeScaling
from lmforge.models.mapping import (HFCheckpointError, check_multiple, config_bool,
                                    config_float, config_int, config_layer_types,
                                    decoder_config_fields, decoder_hf_names)
from lmforge.models.moe_hf import check_top_k, checkpoint_from_hf, checkpoint_to_hf
from lmforge.models.mxfp4 import MXFP4Error, dequantize_state_dict

_LAYER_NAMES = {  # ours -> Hugging Face's, inside layers.{i} (the experts: moe_hf's names)
    **{f"attention.{p}.{t}": f"self_attn.{p}.{t}"
       for p in ("q_proj", "k_proj", "v_proj", "o_proj") for t in ("weight", "bias")},
    "attention.sinks": "self_attn.sinks",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    **{f"feed_forward.{t}": f"mlp.{t}" for t in (
        "gate.weight", "gate.bias", "experts.gate_up_proj", "experts.gate_up_proj_bias",
        "experts.down_proj", "experts.down_proj_bias")},
}
_KINDS = {"sliding_attention": SLIDING, "full_attention": GLOBAL}
# transformers' GptOssConfig defaults for the fields a config may omit
_DEFAULTS = {"head_dim": 64, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
             "rope_theta": 150000.0, "sliding_window": 128, "swiglu_alpha": 1.702,
             "swiglu_limit": 7.0, "router_aux_loss_coef": 0.001, "initializer_range": 0.02}
_DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                 "truncate": False, "original_max_position_embeddings": 4096}
QUANT_METHODS = ("mxfp4",)  # what checkpoint_in dequantizes


def args_from_hf_config(cfg: dict, source: str = "config.json") -> GptOssArgs:
    """A transformers GptOssConfig dict -> ``GptOssArgs``, refusing, naming the field,
    what our model would compute otherwise."""
    _check_fixed(cfg, source)
    dim = config_int(cfg, "hidden_size", source)
    n_heads = config_int(cfg, "num_attention_heads", source)
    n_kv_heads = config_int(cfg, "num_key_value_heads", source, default=n_heads)
    check_multiple(source, "num_attention_heads", n_heads, "num_key_value_heads", n_kv_heads)
    n_layers = config_int(cfg, "num_hidden_layers", source)
    head_dim = config_int(cfg, "head_dim", source, _DEFAULTS["head_dim"])
    if head_dim % 2:
        raise HFCheckpointError(f"{source}: head_dim: {head_dim} must be even for RoPE")
    max_positions = config_int(cfg, "max_position_embeddings", source,
                               _DEFAULTS["max_position_embeddings"])
    theta, scaling = _rope(cfg, source, max_positions)
    check_top_k(config_int(cfg, "num_experts_per_tok", source),
                config_int(cfg, ("num_local_experts", "num_experts"), source), source,
                "num_local_experts")
    return GptOssArgs(
        dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
        vocab_size=config_int(cfg, "vocab_size", source),
        ffn_dim=config_int(cfg, "intermediate_size", source), explicit_head_dim=head_dim,
        max_seq_len=max_positions, rope_theta=theta, rope_scaling=scaling,
        norm_eps=config_float(cfg, "rms_norm_eps", source, _DEFAULTS["rms_norm_eps"]),
        tie_embeddings=config_bool(cfg, "tie_word_embeddings", source, False),
        init_std=_float(cfg, "initializer_range", source, positive=False),
        n_experts=config_int(cfg, ("num_local_experts", "num_experts"), source),
        top_k=config_int(cfg, "num_experts_per_tok", source),
        swiglu_alpha=_float(cfg, "swiglu_alpha", source),
        swiglu_limit=_float(cfg, "swiglu_limit", source),
        router_aux_loss_coef=_float(cfg, "router_aux_loss_coef", source, positive=False),
        sliding_window=config_int(cfg, "sliding_window", source, _DEFAULTS["sliding_window"]),
        layer_types=_layer_types(cfg, n_layers, source))


def _float(cfg: dict, name: str, source: str, positive: bool = True) -> float:
    return config_float(cfg, name, source, _DEFAULTS[name], positive=positive)


def _check_fixed(cfg: dict, source: str) -> None:
    """Biases on every attention projection, and weights lmforge can read."""
    if not config_bool(cfg, "attention_bias", source, True):
        raise HFCheckpointError(f"{source}: attention_bias = false is not supported "
                                f"(gpt-oss's q, k, v and o have biases)")
    quant = cfg.get("quantization_config")
    method = quant.get("quant_method") if isinstance(quant, dict) else quant
    if quant is not None and method not in QUANT_METHODS:
        raise HFCheckpointError(f"{source}: quantization_config.quant_method = {method!r} "
                                f"is not supported (lmforge reads {', '.join(QUANT_METHODS)}"
                                f" and plain weights)")


def _layer_types(cfg: dict, n_layers: int, source: str) -> Optional[tuple[str, ...]]:
    """config.json's per-layer kinds, or None where they alternate as transformers'
    default (sliding first)."""
    kinds = config_layer_types(cfg, n_layers, _KINDS, source)
    if kinds is None:
        return None
    default = GptOssArgs(1, n_layers, 1, 1, 1, 1).attention_kinds
    return None if kinds == default else kinds


def _rope(cfg: dict, source: str, max_positions: int) -> tuple[float, Optional[RopeScaling]]:
    """(base, scaling) from transformers 5's rope_parameters (the base inside) or 4's
    rope_theta / rope_scaling; neither: transformers' default, YaRN 32x from 4096."""
    name = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    rope = cfg.get(name) or (None if "rope_theta" in cfg else _DEFAULT_ROPE)
    rope = rope or {}
    if not isinstance(rope, dict):
        raise HFCheckpointError(f"{source}: {name}: {rope!r} is not an object")
    where = f"{source}: {name}"
    theta = (config_float(cfg, "rope_theta", source) if cfg.get("rope_theta") is not None
             else config_float(rope, "rope_theta", where, _DEFAULTS["rope_theta"]))
    return theta, rope_scaling_from(rope, where, max_positions)


def hf_config_from_args(args: GptOssArgs) -> dict:
    """``GptOssArgs`` -> a config.json dict that transformers 5 loads (plain weights: no
    quantization_config)."""
    kinds = {SLIDING: "sliding_attention", GLOBAL: "full_attention"}
    rope = rope_scaling_dict(args.rope_scaling) or {"rope_type": "default"}
    cfg = decoder_config_fields(args, "GptOssForCausalLM", "gpt_oss")
    del cfg["rope_theta"]  # (transformers 5 keeps it in rope_parameters)
    return cfg | {
        "head_dim": args.head_dim, "attention_bias": True, "hidden_act": "silu",
        "rope_parameters": rope | {"rope_theta": args.rope_theta},
        "sliding_window": args.sliding_window,
        "layer_types": [kinds[k] for k in args.attention_kinds],
        "num_local_experts": args.n_experts, "num_experts_per_tok": args.top_k,
        "swiglu_alpha": args.swiglu_alpha, "swiglu_limit": args.swiglu_limit,
        "router_aux_loss_coef": args.router_aux_loss_coef, "output_router_logits": False,
    }


def hf_names(args: GptOssArgs) -> dict[str, str]:
    """Our parameter name -> HF name (the experts' as ``moe_hf`` names them in the block's
    layout: ``checkpoint_in`` and ``checkpoint_out`` convert the files' own)."""
    return decoder_hf_names(args, _LAYER_NAMES)


def checkpoint_in(sd: dict, args: GptOssArgs, source: str) -> dict:
    """The files' tensors (MXFP4 experts dequantized) in the MoE block's layout."""
    if any(k.endswith("_blocks") for k in sd):
        sd = _dequantized(sd, args, source)
    return checkpoint_from_hf(sd, "gpt_oss", args.n_experts, source)


def _dequantized(sd: dict, args: GptOssArgs, source: str) -> dict:
    """The MXFP4 expert weights as plain tensors in the dtype of the others (bf16 in the
    released files), each checked against the shape the config gives it."""
    expected = {f"model.layers.{i}.mlp.experts.{name}": shape
                for i in range(args.n_layers) for name, shape in expert_shapes(args).items()}
    plain = sd.get("model.embed_tokens.weight")
    dtype = plain.dtype if plain is not None and plain.is_floating_point() else torch.bfloat16
    try:
        return dequantize_state_dict(sd, expected, dtype)
    except MXFP4Error as e:
        raise HFCheckpointError(f"{source}: {e}") from None


def checkpoint_out(sd: dict, args: GptOssArgs) -> dict:
    """The experts as transformers' ``save_pretrained`` writes them (plain)."""
    return checkpoint_to_hf(sd, "gpt_oss")
