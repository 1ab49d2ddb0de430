"""Hugging Face's DeepSeek-V3 (``model_type`` deepseek_v3: DeepSeek-V3/R1, Moonlight) <->
lmforge's ``DeepseekV3``: config.json fields, parameter names, and the checkpoint files'
per-expert tensors, stacked on load and split on export (``models/moe_hf.py``), as
transformers 5 does.

Two things a released checkpoint holds that the model does not:

- the multi-token-prediction (MTP) layers, ``num_nextn_predict_layers`` of them, stored
  as the layers after the last (DeepSeek-V3: ``model.layers.61.*``). They serve
  speculative decoding and the MTP training loss, neither of which lmforge has, and
  transformers skips them too. The rule: the tensors of layers ``num_hidden_layers`` ..
  ``num_hidden_layers + num_nextn_predict_layers - 1`` are dropped on load; a layer past
  those is still refused as unexpected. An export holds no MTP tensors and keeps the
  count as read (as transformers' ``save_pretrained`` writes it).
- FP8 weights (``quantization_config`` with quant_method fp8, each weight with a
  ``weight_scale_inv``): refused, naming the field or the tensor; dequantize to bf16
  first.
"""
from __future__ import annotations

import re
from typing import Optional

import torch

from lmforge.models.deepseek_v3.model import DeepseekV3Args, DeepseekV3Block
from lmforge.models.llama.hf import rope_theta
from lmforge.models.mapping import (HFCheckpointError, config_bool, config_float,
                                    config_int, decoder_config_fields, decoder_hf_names)
from lmforge.models.mla import YarnScaling
from lmforge.models.moe_hf import checkpoint_from_hf, checkpoint_to_hf

# transformers' DeepseekV3Config defaults for the fields a config may omit
_DEFAULTS = {
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "initializer_range": 0.02, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "rope_interleave": True, "attention_bias": False,
    "n_routed_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 2048,
    "n_shared_experts": 1, "n_group": 8, "topk_group": 4, "norm_topk_prob": True,
    "routed_scaling_factor": 2.5, "first_k_dense_replace": 3, "num_nextn_predict_layers": 1,
}
# Fields our model computes one way only (absent: that way). DeepSeek's own code reads
# topk_method, scoring_func and moe_layer_freq; transformers assumes these values.
_REQUIRED = {
    "hidden_act": ("silu", "the MLPs are SwiGLU"),
    "topk_method": ("noaux_tc", "the router is DeepSeek-V3's group-limited top-k with "
                                "the correction bias"),
    "scoring_func": ("sigmoid", "the router scores experts by a sigmoid"),
    "moe_layer_freq": (1, "every layer after first_k_dense_replace is an MoE layer"),
}
# Our block's prefixes -> transformers'; inside them the names are the same.
_PREFIXES = (("attention_norm.", "input_layernorm."), ("ffn_norm.", "post_attention_layernorm."),
             ("attention.", "self_attn."), ("feed_forward.", "mlp."))
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def args_from_hf_config(cfg: dict, source: str = "config.json") -> DeepseekV3Args:
    """A transformers (4 or 5) or DeepSeek config.json dict -> ``DeepseekV3Args``;
    refused, naming the field, whatever our model would compute otherwise."""
    _check_supported(cfg, source)
    d = _DEFAULTS
    n_heads = config_int(cfg, "num_attention_heads", source)
    max_positions = config_int(cfg, "max_position_embeddings", source,
                               d["max_position_embeddings"])
    args = DeepseekV3Args(
        dim=config_int(cfg, "hidden_size", source),
        n_layers=config_int(cfg, "num_hidden_layers", source), n_heads=n_heads,
        n_kv_heads=n_heads, vocab_size=config_int(cfg, "vocab_size", source),
        ffn_dim=config_int(cfg, "intermediate_size", source), max_seq_len=max_positions,
        rope_theta=rope_theta(cfg, source, _DEFAULTS["rope_theta"]),
        rope_scaling=_rope_scaling(cfg, source, max_positions),
        norm_eps=config_float(cfg, "rms_norm_eps", source, d["rms_norm_eps"]),
        tie_embeddings=config_bool(cfg, "tie_word_embeddings", source,
                                   d["tie_word_embeddings"]),
        init_std=config_float(cfg, "initializer_range", source, d["initializer_range"],
                              positive=False),
        **_attention_fields(cfg, source), **_expert_fields(cfg, source))
    _check_experts(args, source)
    return args


def _check_supported(cfg: dict, source: str) -> None:
    quantization = cfg.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        raise HFCheckpointError(f"{source}: quantization_config (quant_method {method!r}) is "
                                f"not supported: lmforge loads unquantized weights "
                                f"(dequantize DeepSeek's fp8 weights to bf16 first)")
    for name, (wanted, why) in _REQUIRED.items():
        if cfg.get(name, wanted) != wanted:
            raise HFCheckpointError(f"{source}: {name} = {cfg[name]!r} is not supported "
                                    f"(lmforge needs {wanted!r}: {why})")
    heads = cfg.get("num_key_value_heads")
    if heads is not None and heads != cfg.get("num_attention_heads"):
        raise HFCheckpointError(f"{source}: num_key_value_heads = {heads!r} must equal "
                                f"num_attention_heads ({cfg.get('num_attention_heads')!r}): "
                                f"latent attention gives every head its own key and value")


def _attention_fields(cfg: dict, source: str) -> dict:
    d = _DEFAULTS
    q_lora_rank = cfg.get("q_lora_rank", d["q_lora_rank"])  # null: a plain q_proj
    rope = config_int(cfg, "qk_rope_head_dim", source, d["qk_rope_head_dim"])
    if rope % 2:
        raise HFCheckpointError(f"{source}: qk_rope_head_dim: {rope} must be even for RoPE")
    return dict(
        q_lora_rank=None if q_lora_rank is None else config_int(cfg, "q_lora_rank", source,
                                                                d["q_lora_rank"]),
        kv_lora_rank=config_int(cfg, "kv_lora_rank", source, d["kv_lora_rank"]),
        qk_nope_head_dim=config_int(cfg, "qk_nope_head_dim", source, d["qk_nope_head_dim"]),
        qk_rope_head_dim=rope,
        v_head_dim=config_int(cfg, "v_head_dim", source, d["v_head_dim"]),
        rope_interleave=config_bool(cfg, "rope_interleave", source, d["rope_interleave"]),
        attention_bias=config_bool(cfg, "attention_bias", source, d["attention_bias"]))


def _expert_fields(cfg: dict, source: str) -> dict:
    d = _DEFAULTS
    return dict(
        n_experts=config_int(cfg, ("n_routed_experts", "num_local_experts"), source,
                             d["n_routed_experts"]),
        top_k=config_int(cfg, "num_experts_per_tok", source, d["num_experts_per_tok"]),
        moe_ffn_dim=config_int(cfg, "moe_intermediate_size", source,
                               d["moe_intermediate_size"]),
        n_shared_experts=config_int(cfg, "n_shared_experts", source, d["n_shared_experts"]),
        n_groups=config_int(cfg, "n_group", source, d["n_group"]),
        topk_groups=config_int(cfg, "topk_group", source, d["topk_group"]),
        norm_topk_prob=config_bool(cfg, "norm_topk_prob", source, d["norm_topk_prob"]),
        routed_scaling_factor=config_float(cfg, "routed_scaling_factor", source,
                                           d["routed_scaling_factor"]),
        first_k_dense=_count(cfg, "first_k_dense_replace", source),
        mtp_layers=_count(cfg, ("num_nextn_predict_layers", "num_mtp_layers"), source))


def _count(cfg: dict, names, source: str) -> int:
    """A whole number that may be 0 (config_int's must be positive)."""
    names = (names,) if isinstance(names, str) else names
    name = next((n for n in names if cfg.get(n) is not None), None)
    if name is None:
        return _DEFAULTS[names[0]]
    value = cfg[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise HFCheckpointError(f"{source}: {name}: {value!r} is not a whole number >= 0")
    return value


# The MoEArgs field each config.json field fills, for the block's own checks' messages.
_EXPERT_KEYS = {"n_experts": "n_routed_experts", "top_k": "num_experts_per_tok",
                "n_groups": "n_group", "topk_groups": "topk_group"}


def _check_experts(args: DeepseekV3Args, source: str) -> None:
    """The experts' shape as the MoE block checks it (groups that split the experts, a
    top-k the open groups can give), in config.json's names; dense layers that exist."""
    if args.first_k_dense > args.n_layers:
        raise HFCheckpointError(f"{source}: first_k_dense_replace: {args.first_k_dense} is "
                                f"more than the {args.n_layers} layers (num_hidden_layers)")
    try:
        args.moe
    except ValueError as e:
        message = str(e)
        for ours, theirs in _EXPERT_KEYS.items():
            message = re.sub(rf"\b{ours}\b", theirs, message)
        raise HFCheckpointError(f"{source}: {message}") from None


def _rope_scaling(cfg: dict, source: str, max_positions: int) -> Optional[YarnScaling]:
    """rope_scaling (4.x, DeepSeek's) or rope_parameters (5.x): none, or DeepSeek's YaRN."""
    name = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    rope, where = cfg.get(name) or {}, f"{source}: {name}"
    if not isinstance(rope, dict):
        raise HFCheckpointError(f"{where}: {rope!r} is not an object")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind != "yarn":
        raise HFCheckpointError(f"{where}.rope_type = {kind!r} is not supported (lmforge "
                                f"supports default and yarn for deepseek_v3)")
    if rope.get("attention_factor") is not None:
        raise HFCheckpointError(f"{where}.attention_factor: an explicit YaRN attention "
                                f"factor is not supported (DeepSeek's comes from mscale)")
    mscales = {key: None if rope.get(key) is None else config_float(rope, key, where)
               for key in ("mscale", "mscale_all_dim")}
    return YarnScaling(
        factor=config_float(rope, "factor", where),
        original_max_position_embeddings=config_int(
            rope, "original_max_position_embeddings", where, max_positions),
        beta_fast=config_float(rope, "beta_fast", where, 32.0),
        beta_slow=config_float(rope, "beta_slow", where, 1.0),
        truncate=config_bool(rope, "truncate", where, True), **mscales)


def _rope_scaling_dict(s: Optional[YarnScaling]) -> Optional[dict]:
    if s is None:
        return None
    mscales = {k: getattr(s, k) for k in ("mscale", "mscale_all_dim")
               if getattr(s, k) is not None}
    return {"rope_type": "yarn", "factor": s.factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
            "beta_fast": s.beta_fast, "beta_slow": s.beta_slow, **mscales,
            **({} if s.truncate else {"truncate": False})}


def hf_config_from_args(args: DeepseekV3Args) -> dict:
    """``DeepseekV3Args`` -> a config.json dict that transformers 4.x and 5 load (the
    rope fields in 4.x's form, which 5 converts), with DeepSeek's routing fields."""
    return decoder_config_fields(args, "DeepseekV3ForCausalLM", "deepseek_v3") | {
        "rope_scaling": _rope_scaling_dict(args.rope_scaling), "hidden_act": "silu",
        "q_lora_rank": args.q_lora_rank, "kv_lora_rank": args.kv_lora_rank,
        "qk_nope_head_dim": args.qk_nope_head_dim, "qk_rope_head_dim": args.qk_rope_head_dim,
        "v_head_dim": args.v_head_dim, "rope_interleave": args.rope_interleave,
        "attention_bias": args.attention_bias, "n_routed_experts": args.n_experts,
        "num_experts_per_tok": args.top_k, "moe_intermediate_size": args.moe_ffn_dim,
        "n_shared_experts": args.n_shared_experts, "n_group": args.n_groups,
        "topk_group": args.topk_groups, "norm_topk_prob": args.norm_topk_prob,
        "routed_scaling_factor": args.routed_scaling_factor,
        "first_k_dense_replace": args.first_k_dense, "topk_method": "noaux_tc",
        "scoring_func": "sigmoid", "moe_layer_freq": 1,
        "num_nextn_predict_layers": args.mtp_layers, "output_router_logits": False}


def hf_names(args: DeepseekV3Args) -> dict[str, str]:
    """Our tensor name -> HF name (transformers 5's in-memory names: the checkpoint
    files' per-expert tensors are ``checkpoint_in``'s and ``checkpoint_out``'s), the
    routers' ``e_score_correction_bias`` buffers included: checkpoints hold them. Inside
    a block our names are transformers' (``mla.py``, ``moe.py``), so they are read off a
    dense and a sparse block built on the meta device."""
    names = decoder_hf_names(args, {})  # the embedding, the final norm, the head
    with torch.device("meta"):
        keys = {sparse: list(DeepseekV3Block(args, layer).state_dict())
                for sparse, layer in ((False, 0), (True, args.n_layers - 1))
                if (layer >= args.first_k_dense) == sparse}
    for i in range(args.n_layers):
        for key in keys[i >= args.first_k_dense]:
            names[f"layers.{i}.{key}"] = f"model.layers.{i}.{_theirs(key)}"
    return names


def _theirs(key: str) -> str:
    for ours, theirs in _PREFIXES:
        if key.startswith(ours):
            return theirs + key[len(ours):]
    raise ValueError(f"{key}: no Hugging Face name for this block tensor")


def checkpoint_in(sd: dict, args: DeepseekV3Args, source: str) -> dict:
    """A checkpoint's tensors without the MTP layers (the module docstring's rule), each
    MoE layer's per-expert weights stacked; FP8 scales refused."""
    scaled = next((k for k in sd if k.endswith("weight_scale_inv")), None)
    if scaled is not None:
        raise HFCheckpointError(f"{source}: {scaled}: FP8 weights with block scales are not "
                                f"supported (dequantize to bf16 first)")
    mtp = range(args.n_layers, args.n_layers + args.mtp_layers)
    kept = {k: v for k, v in sd.items() if not _in_layers(k, mtp)}
    return checkpoint_from_hf(kept, "per_expert", args.n_experts, source)


def _in_layers(name: str, layers: range) -> bool:
    match = _LAYER.match(name)
    return match is not None and int(match[1]) in layers


def checkpoint_out(sd: dict, args: DeepseekV3Args) -> dict:
    """The stacked expert weights split per expert, as the released checkpoints (and
    transformers' ``save_pretrained``) store them."""
    return checkpoint_to_hf(sd, "per_expert")
