"""Hugging Face's Gemma 3 text model (``model_type`` gemma3_text) <-> lmforge's
``Gemma3``: config.json fields (transformers 4's and 5's layouts) and parameter names."""
from __future__ import annotations

from lmforge.models.gemma3.model import GLOBAL, SLIDING, Gemma3Args
from lmforge.models.mapping import (HFCheckpointError, check_multiple, config_bool,
                                    config_float, config_int, config_layer_types,
                                    decoder_config_fields, decoder_hf_names)

_LAYER_NAMES = {  # ours -> Hugging Face, inside layers.{i}
    **{f"attention.{p}.weight": f"self_attn.{p}.weight"
       for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")},
    **{f"feed_forward.{p}.weight": f"mlp.{p}.weight"
       for p in ("gate_proj", "up_proj", "down_proj")},
    "attention_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffn_norm.weight": "post_feedforward_layernorm.weight",
}
_KINDS = {"sliding_attention": SLIDING, "full_attention": GLOBAL}
# Fields our model computes one way only: config.json must leave them at this value.
_FIXED = {"attn_logit_softcapping": None, "final_logit_softcapping": None,
          "use_bidirectional_attention": False, "attention_bias": False}


def args_from_hf_config(cfg: dict, source: str = "config.json") -> Gemma3Args:
    """A transformers Gemma3TextConfig dict -> ``Gemma3Args``, refusing, with the field
    named, what our model would compute differently."""
    _check_fixed(cfg, source)
    dim = config_int(cfg, "hidden_size", source)
    n_heads = config_int(cfg, "num_attention_heads", source)
    n_kv_heads = config_int(cfg, "num_key_value_heads", source, default=n_heads)
    check_multiple(source, "num_attention_heads", n_heads, "num_key_value_heads", n_kv_heads)
    n_layers = config_int(cfg, "num_hidden_layers", source)
    pattern = config_int(cfg, "sliding_window_pattern", source, default=6)
    head_dim = config_int(cfg, "head_dim", source, default=256)
    if head_dim % 2:
        raise HFCheckpointError(f"{source}: head_dim: {head_dim} must be even for RoPE")
    global_theta, local_theta, factor = _rope(cfg, source)
    return Gemma3Args(
        dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
        vocab_size=config_int(cfg, "vocab_size", source),
        ffn_dim=config_int(cfg, "intermediate_size", source), explicit_head_dim=head_dim,
        max_seq_len=config_int(cfg, "max_position_embeddings", source, 131072),
        rope_theta=global_theta, rope_local_theta=local_theta, rope_linear_factor=factor,
        query_pre_attn_scalar=config_float(cfg, "query_pre_attn_scalar", source, 256.0),
        sliding_window=config_int(cfg, "sliding_window", source, 4096),
        sliding_pattern=pattern, layer_types=_layer_types(cfg, n_layers, pattern, source),
        norm_eps=config_float(cfg, "rms_norm_eps", source, 1e-6),
        tie_embeddings=config_bool(cfg, "tie_word_embeddings", source, True),
        init_std=config_float(cfg, "initializer_range", source, 0.02, positive=False))


def _check_fixed(cfg: dict, source: str) -> None:
    for key, value in _FIXED.items():
        if cfg.get(key, value) != value:
            raise HFCheckpointError(f"{source}: {key} = {cfg[key]!r} is not supported "
                                    f"(lmforge's Gemma 3 computes {key} = {value!r})")
    act = cfg.get("hidden_activation", cfg.get("hidden_act")) or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise HFCheckpointError(f"{source}: hidden_activation = {act!r}: Gemma 3 computes "
                                f"gelu_pytorch_tanh")


def _layer_types(cfg: dict, n_layers: int, pattern: int, source: str):
    """config.json's per-layer kinds, or None where they follow the pattern."""
    kinds = config_layer_types(cfg, n_layers, _KINDS, source)
    if kinds is None:
        return None
    by_pattern = Gemma3Args(1, n_layers, 1, 1, 1, 1, sliding_pattern=pattern).attention_kinds
    return None if kinds == by_pattern else kinds


def _rope(cfg: dict, source: str) -> tuple[float, float, float]:
    """(global base, local base, the global layers' linear factor) from transformers 4's
    rope_theta / rope_local_base_freq / rope_scaling or 5's per-kind rope_parameters."""
    params = cfg.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise HFCheckpointError(f"{source}: rope_parameters: {params!r} is not an object")
    full = params.get("full_attention") or {}
    local = params.get("sliding_attention") or {}
    where = f"{source}: rope_parameters"
    global_theta = (config_float(cfg, "rope_theta", source) if cfg.get("rope_theta")
                    else config_float(full, "rope_theta", f"{where}.full_attention", 1e6))
    local_theta = (config_float(cfg, "rope_local_base_freq", source)
                   if cfg.get("rope_local_base_freq")
                   else config_float(local, "rope_theta", f"{where}.sliding_attention", 1e4))
    if local.get("rope_type", "default") != "default":
        raise HFCheckpointError(f"{where}.sliding_attention.rope_type = "
                                f"{local['rope_type']!r} is not supported ('default')")
    scaling, name = (cfg["rope_scaling"], "rope_scaling") if cfg.get("rope_scaling") else (
        full, "rope_parameters.full_attention")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return global_theta, local_theta, 1.0
    if kind != "linear":
        raise HFCheckpointError(f"{source}: {name}.rope_type = {kind!r} is not supported "
                                f"(Gemma 3: 'default' and 'linear')")
    return global_theta, local_theta, config_float(scaling, "factor", f"{source}: {name}")


def hf_config_from_args(args: Gemma3Args) -> dict:
    """``Gemma3Args`` -> a config.json dict that transformers 4.50+ and 5.x load."""
    kinds = {SLIDING: "sliding_attention", GLOBAL: "full_attention"}
    scaling = None if args.rope_linear_factor == 1.0 else {
        "rope_type": "linear", "factor": args.rope_linear_factor}
    return decoder_config_fields(args, "Gemma3ForCausalLM", "gemma3_text") | {
        "head_dim": args.head_dim, "rope_local_base_freq": args.rope_local_theta,
        "rope_scaling": scaling, "query_pre_attn_scalar": _whole(args.query_pre_attn_scalar),
        "sliding_window": args.sliding_window, "sliding_window_pattern": args.sliding_pattern,
        "layer_types": [kinds[k] for k in args.attention_kinds],
        "hidden_activation": "gelu_pytorch_tanh", "attention_bias": False,
        "attn_logit_softcapping": None, "final_logit_softcapping": None,
    }


def _whole(value: float):
    """An int where the number is whole (transformers 5 types the field as int)."""
    return int(value) if float(value).is_integer() else value


def hf_names(args: Gemma3Args) -> dict[str, str]:
    """Our parameter name -> HF name for every tensor an HF checkpoint holds."""
    return decoder_hf_names(args, _LAYER_NAMES)
