"""Hugging Face's Phi-3 (``model_type`` phi3) <-> lmforge's ``Phi3``: config.json fields
and parameter names. The names are HF's; the rows of the fused projections are permuted
between HF's order and our grouped one by ``models/hf.py`` (``models.family.Fused``)."""
from __future__ import annotations

import math
from typing import Optional

from lmforge.models.mapping import (HFCheckpointError, check_multiple, config_bool,
                                    config_float, config_int, decoder_config_fields,
                                    decoder_hf_names)
from lmforge.models.phi3.model import LongRope, Phi3Args

_LAYER_NAMES = {  # ours -> Hugging Face, inside layers.{i}
    "attention.qkv_proj.weight": "self_attn.qkv_proj.weight",
    "attention.o_proj.weight": "self_attn.o_proj.weight",
    "feed_forward.gate_up_proj.weight": "mlp.gate_up_proj.weight",
    "feed_forward.down_proj.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}

_DEFAULTS = {  # transformers' Phi3Config defaults for fields a config may omit
    "max_position_embeddings": 4096, "original_max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "initializer_range": 0.02, "partial_rotary_factor": 1.0,
}


def args_from_hf_config(cfg: dict, source: str = "config.json") -> Phi3Args:
    """A transformers Phi3Config dict (v4 or v5 layout) -> ``Phi3Args``, refusing, with
    the field named, what our model would compute differently."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise HFCheckpointError(f"{source}: hidden_act = {cfg['hidden_act']!r}: Phi-3 "
                                f"computes silu")
    dim = config_int(cfg, "hidden_size", source)
    n_heads = config_int(cfg, "num_attention_heads", source)
    n_kv_heads = config_int(cfg, "num_key_value_heads", source, default=n_heads)
    check_multiple(source, "hidden_size", dim, "num_attention_heads", n_heads)
    check_multiple(source, "num_attention_heads", n_heads, "num_key_value_heads", n_kv_heads)
    if cfg.get("head_dim") not in (None, dim // n_heads):
        raise HFCheckpointError(f"{source}: head_dim: {cfg['head_dim']!r}; Phi-3 heads are "
                                f"hidden_size / num_attention_heads = {dim // n_heads}")
    max_seq_len = config_int(cfg, "max_position_embeddings", source,
                             _DEFAULTS["max_position_embeddings"])
    partial = _rope_field(cfg, "partial_rotary_factor", source)
    args = Phi3Args(
        dim=dim, n_layers=config_int(cfg, "num_hidden_layers", source), n_heads=n_heads,
        n_kv_heads=n_kv_heads, vocab_size=config_int(cfg, "vocab_size", source),
        ffn_dim=config_int(cfg, "intermediate_size", source), max_seq_len=max_seq_len,
        rope_theta=_rope_field(cfg, "rope_theta", source), partial_rotary_factor=partial,
        norm_eps=config_float(cfg, "rms_norm_eps", source, _DEFAULTS["rms_norm_eps"]),
        tie_embeddings=config_bool(cfg, "tie_word_embeddings", source,
                                   _DEFAULTS["tie_word_embeddings"]),
        init_std=config_float(cfg, "initializer_range", source,
                              _DEFAULTS["initializer_range"], positive=False),
        sliding_window=config_int(cfg, "sliding_window", source, default=None))
    if args.rotary_dim % 2 or partial > 1:
        raise HFCheckpointError(f"{source}: partial_rotary_factor: {partial!r} must rotate "
                                f"an even number of at most head_dim features")
    rope = _long_rope(cfg, args, source)
    return args if rope is None else Phi3Args(**{**args.__dict__, "rope_scaling": rope})


def _rope_params(cfg: dict, source: str) -> tuple[str, dict]:
    """(its key, the RoPE object): ``rope_scaling`` (transformers 4) or
    ``rope_parameters`` (5)."""
    name = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    rope = cfg.get(name) or {}
    if not isinstance(rope, dict):
        raise HFCheckpointError(f"{source}: {name}: {rope!r} is not an object")
    return name, rope


def _rope_field(cfg: dict, key: str, source: str) -> float:
    """A RoPE number at the top level (transformers 4) or in rope_parameters (5)."""
    if cfg.get(key) is not None:
        return config_float(cfg, key, source)
    name, rope = _rope_params(cfg, source)
    return config_float(rope, key, f"{source}: {name}", _DEFAULTS[key])


def _long_rope(cfg: dict, args: Phi3Args, source: str) -> Optional[LongRope]:
    name, rope = _rope_params(cfg, source)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    where = f"{source}: {name}"
    if kind not in ("longrope", "su", "yarn"):  # su, yarn: Phi-3's early names for it
        raise HFCheckpointError(f"{where}.rope_type = {kind!r} is not supported "
                                f"(Phi-3: 'default' and 'longrope')")
    original = config_int(rope, "original_max_position_embeddings", where, default=None) \
        or config_int(cfg, "original_max_position_embeddings", source,
                      _DEFAULTS["original_max_position_embeddings"])
    factors = [_factors(rope, key, args.rotary_dim // 2, where)
               for key in ("short_factor", "long_factor")]
    return LongRope(*factors, original_max_position_embeddings=original,
                    attention_factor=_attention_factor(rope, args, original, where))


def _factors(rope: dict, key: str, length: int, where: str) -> tuple[float, ...]:
    values = rope.get(key)
    ok = isinstance(values, list) and len(values) == length and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
        for v in values)
    if not ok:
        raise HFCheckpointError(f"{where}.{key}: expected {length} positive numbers (one "
                                f"per rotated frequency), got {values!r}")
    return tuple(float(v) for v in values)


def _attention_factor(rope: dict, args: Phi3Args, original: int, where: str) -> float:
    """The scale on cos and sin: given, or LongRoPE's sqrt(1 + ln(s) / ln(original)) for
    the extension s = factor (given) or max_position_embeddings / original."""
    given = config_float(rope, "attention_factor", where, default=None)
    if given is not None:
        return given
    factor = config_float(rope, "factor", where, default=None) or args.max_seq_len / original
    return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))


def hf_config_from_args(args: Phi3Args) -> dict:
    """``Phi3Args`` -> a config.json dict that transformers 4.45+ and 5.x load."""
    rope = args.rope_scaling
    cfg = decoder_config_fields(args, "Phi3ForCausalLM", "phi3") | {
        "partial_rotary_factor": args.partial_rotary_factor, "rope_scaling": None,
        "sliding_window": args.sliding_window, "hidden_act": "silu", "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
    }
    if rope is not None:
        cfg["original_max_position_embeddings"] = rope.original_max_position_embeddings
        cfg["rope_scaling"] = {
            "rope_type": "longrope", "short_factor": list(rope.short_factor),
            "long_factor": list(rope.long_factor),
            "original_max_position_embeddings": rope.original_max_position_embeddings,
            "attention_factor": rope.attention_factor}
    return cfg


def hf_names(args: Phi3Args) -> dict[str, str]:
    """Our parameter name -> HF name for every tensor an HF checkpoint holds."""
    return decoder_hf_names(args, _LAYER_NAMES)
