"""Hugging Face's Llama, Mistral, Qwen2 and Qwen3 <-> lmforge's ``Llama``: config.json
fields and parameter names (a pure mapping, names only: our q/k use HF's rotate-half RoPE
layout; Meta's interleaved layout is ``meta.py``). Reading and writing model directories
is family-independent: ``models/hf.py``."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from lmforge.models.llama.model import LlamaArgs, RopeScaling
from lmforge.models.mapping import (HFCheckpointError, check_multiple, config_bool,
                                    config_float, config_int, decoder_config_fields,
                                    decoder_hf_names)


_LAYER_NAMES = {  # ours -> Hugging Face, inside layers.{i}
    "attention.q_proj.weight": "self_attn.q_proj.weight",
    "attention.k_proj.weight": "self_attn.k_proj.weight",
    "attention.v_proj.weight": "self_attn.v_proj.weight",
    "attention.o_proj.weight": "self_attn.o_proj.weight",
    "feed_forward.gate_proj.weight": "mlp.gate_proj.weight",
    "feed_forward.up_proj.weight": "mlp.up_proj.weight",
    "feed_forward.down_proj.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}

_LLAMA_DEFAULTS = {  # transformers' LlamaConfig defaults for fields a config may omit
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "initializer_range": 0.02,
}


@dataclass(frozen=True)
class Variant:
    """What one HF ``model_type`` is, as flags on lmforge's Llama."""
    architecture: str
    attention_bias: bool = False  # q/k/v biases always present (Qwen2's modeling code)
    qk_norm: bool = False
    window_key: Optional[str] = None  # the config key that turns a sliding window on


VARIANTS = {
    "llama": Variant("LlamaForCausalLM"),
    # Mistral: a window whenever config.json's sliding_window is set (transformers' rule).
    "mistral": Variant("MistralForCausalLM", window_key="sliding_window"),
    # Qwen2/Qwen3: a window only with use_sliding_window, and then only on some layers
    # (max_window_layers), which our one-window model cannot express: refused.
    "qwen2": Variant("Qwen2ForCausalLM", attention_bias=True, window_key="use_sliding_window"),
    "qwen3": Variant("Qwen3ForCausalLM", qk_norm=True, window_key="use_sliding_window"),
    # The mixtures of experts with these attentions (models/qwen3_moe: their experts)
    "qwen3_moe": Variant("Qwen3MoeForCausalLM", qk_norm=True, window_key="use_sliding_window"),
    "mixtral": Variant("MixtralForCausalLM", window_key="sliding_window"),
}

# config.json fields each family must leave at the value our model computes with (the
# default when absent). Qwen2 has no attention_bias key: its q/k/v biases are fixed.
_REQUIRED = {"llama": {"attention_bias": False, "mlp_bias": False},
             "mistral": {}, "qwen2": {}, "qwen3": {"attention_bias": False},
             "qwen3_moe": {"attention_bias": False}, "mixtral": {},
             "all": {"hidden_act": "silu"}}


def as_variant(args: LlamaArgs, model_type: str) -> LlamaArgs:
    """``args`` as the Llama-shaped ``model_type``: its fixed flags; a window only where
    the variant has one."""
    v = VARIANTS[model_type]
    window = args.sliding_window if v.window_key == "sliding_window" else None
    return replace(args, family=model_type, attention_bias=v.attention_bias,
                   qk_norm=v.qk_norm, sliding_window=window)


def _variant_of(cfg: dict, source: str) -> str:
    model_type = cfg.get("model_type")
    if model_type not in VARIANTS:
        raise HFCheckpointError(f"{source}: model_type = {model_type!r} is not supported "
                                f"(lmforge loads {', '.join(sorted(VARIANTS))})")
    for name, wanted in (_REQUIRED["all"] | _REQUIRED[model_type]).items():
        if cfg.get(name, wanted) != wanted:
            raise HFCheckpointError(f"{source}: {name} = {cfg[name]!r} is not supported "
                                    f"for model_type {model_type!r} (lmforge needs "
                                    f"{wanted!r})")
    return model_type


def _sliding_window(cfg: dict, family: str, source: str) -> Optional[int]:
    key = VARIANTS[family].window_key
    if key is None or not cfg.get(key):
        return None
    if key != "sliding_window" or any(
            t != "full_attention" for t in cfg.get("layer_types") or []):
        raise HFCheckpointError(f"{source}: {key} = {cfg[key]!r} is not supported for "
                                f"model_type {family!r} (lmforge applies one window to "
                                f"every layer; per-layer windows are not implemented)")
    return config_int(cfg, "sliding_window", source)


def _heads(cfg: dict, source: str) -> tuple[int, int, int, Optional[int]]:
    """(hidden_size, heads, KV heads, the explicit head_dim or None when it is
    hidden_size / heads anyway), checked to divide as attention and RoPE need."""
    dim = config_int(cfg, "hidden_size", source)
    n_heads = config_int(cfg, "num_attention_heads", source)
    n_kv_heads = config_int(cfg, "num_key_value_heads", source, default=n_heads)
    check_multiple(source, "num_attention_heads", n_heads, "num_key_value_heads", n_kv_heads)
    head_dim = config_int(cfg, "head_dim", source, default=None)
    if head_dim is None or (dim % n_heads == 0 and head_dim == dim // n_heads):
        check_multiple(source, "hidden_size", dim, "num_attention_heads", n_heads)
        head_dim, explicit = dim // n_heads, None
    else:
        explicit = head_dim
    if head_dim % 2:
        raise HFCheckpointError(f"{source}: head_dim: {head_dim} (hidden_size / "
                                f"num_attention_heads unless set) must be even for RoPE")
    return dim, n_heads, n_kv_heads, explicit


def args_from_hf_config(cfg: dict, source: str = "config.json") -> LlamaArgs:
    """A transformers Llama, Mistral, Qwen2 or Qwen3 config dict (v4 or v5 layout) ->
    ``LlamaArgs``. Refuses, naming the field, anything our model would compute
    differently, and shapes it cannot have (a size that is not a positive integer,
    heads that do not divide)."""
    family = _variant_of(cfg, source)
    dim, n_heads, n_kv_heads, explicit_head_dim = _heads(cfg, source)
    d = _LLAMA_DEFAULTS
    return LlamaArgs(
        dim=dim, n_layers=config_int(cfg, "num_hidden_layers", source), n_heads=n_heads,
        n_kv_heads=n_kv_heads, vocab_size=config_int(cfg, "vocab_size", source),
        ffn_dim=config_int(cfg, "intermediate_size", source),
        max_seq_len=config_int(cfg, "max_position_embeddings", source,
                               d["max_position_embeddings"]),
        rope_theta=rope_theta(cfg, source), rope_scaling=_rope_scaling(cfg, source),
        norm_eps=config_float(cfg, "rms_norm_eps", source, d["rms_norm_eps"]),
        tie_embeddings=config_bool(cfg, "tie_word_embeddings", source,
                                   d["tie_word_embeddings"]),
        init_std=config_float(cfg, "initializer_range", source, d["initializer_range"],
                              positive=False),
        family=family, explicit_head_dim=explicit_head_dim,
        attention_bias=VARIANTS[family].attention_bias, qk_norm=VARIANTS[family].qk_norm,
        sliding_window=_sliding_window(cfg, family, source))


def rope_theta(cfg: dict, source: str,
               default: float = _LLAMA_DEFAULTS["rope_theta"]) -> float:
    """config.json's RoPE base: transformers 5 moved rope_theta into rope_parameters;
    4.x keeps it at the top level."""
    if cfg.get("rope_theta") is not None:
        return config_float(cfg, "rope_theta", source)
    params = cfg.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise HFCheckpointError(f"{source}: rope_parameters: {params!r} is not an object")
    return config_float(params, "rope_theta", f"{source}: rope_parameters", default)


def _rope_scaling(cfg: dict, source: str) -> Optional[RopeScaling]:
    name = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    rope = cfg.get(name) or {}
    if not isinstance(rope, dict):
        raise HFCheckpointError(f"{source}: {name}: {rope!r} is not an object")
    return rope_scaling_from(rope, f"{source}: {name}", config_int(
        cfg, "max_position_embeddings", source, _LLAMA_DEFAULTS["max_position_embeddings"]))


ROPE_KINDS = ("default", "linear", "llama3", "yarn")


def rope_scaling_from(rope: dict, where: str, max_positions: int) -> Optional[RopeScaling]:
    """transformers' rope_scaling / rope_parameters mapping -> ``RopeScaling`` (None: no
    scaling), refusing a kind or a field lmforge would compute otherwise; ``where`` names
    it (``config.json: rope_scaling``, ``model.rope_scaling``)."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_KINDS:
        raise HFCheckpointError(f"{where}.rope_type = {kind!r} is not supported (lmforge "
                                f"supports {', '.join(ROPE_KINDS)})")
    if kind == "default":
        return None
    factor = config_float(rope, "factor", where)
    if kind == "linear":
        return RopeScaling(factor=factor, kind="linear")
    if kind == "llama3":
        return RopeScaling(factor, config_float(rope, "low_freq_factor", where),
                           config_float(rope, "high_freq_factor", where),
                           config_int(rope, "original_max_position_embeddings", where))
    # (transformers 5 takes max_position_embeddings where the original length is absent)
    original = config_int(rope, "original_max_position_embeddings", where, max_positions)
    for unsupported in ("mscale", "mscale_all_dim"):
        if rope.get(unsupported):
            raise HFCheckpointError(f"{where}.{unsupported}: DeepSeek's YaRN attention "
                                    f"factor is not supported")
    attention = rope.get("attention_factor")
    return RopeScaling(
        factor=factor, original_max_position_embeddings=original, kind="yarn",
        beta_fast=config_float(rope, "beta_fast", where, 32.0),
        beta_slow=config_float(rope, "beta_slow", where, 1.0),
        attention_factor=None if attention is None else config_float(rope, "attention_factor",
                                                                      where),
        truncate=config_bool(rope, "truncate", where, True))


def rope_scaling_dict(s: Optional[RopeScaling]) -> Optional[dict]:
    """``RopeScaling`` as transformers' rope_scaling mapping (the inverse of the above)."""
    if s is None:
        return None
    if s.kind == "linear":
        return {"rope_type": "linear", "factor": s.factor}
    if s.kind == "yarn":
        return {"rope_type": "yarn", "factor": s.factor, "beta_fast": s.beta_fast,
                "beta_slow": s.beta_slow, "truncate": s.truncate,
                "original_max_position_embeddings": s.original_max_position_embeddings,
                **({"attention_factor": s.attention_factor}
                   if s.attention_factor is not None else {})}
    return {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings}


def hf_config_from_args(args: LlamaArgs) -> dict:
    """``LlamaArgs`` -> a config.json dict that transformers 4.45+ and 5.x load."""
    rope_scaling = rope_scaling_dict(args.rope_scaling)
    architecture = VARIANTS[args.family].architecture
    cfg = decoder_config_fields(args, architecture, args.family) | {
        "head_dim": args.head_dim, "rope_scaling": rope_scaling, "hidden_act": "silu",
        "attention_bias": args.attention_bias, "mlp_bias": False,
    }
    return cfg | _family_fields(args)


def _family_fields(args: LlamaArgs) -> dict:
    window_key = VARIANTS[args.family].window_key
    if window_key == "sliding_window":
        return {"sliding_window": args.sliding_window}
    if window_key == "use_sliding_window":
        return {"use_sliding_window": False, "sliding_window": None}
    return {}


def hf_names(args: LlamaArgs) -> dict[str, str]:
    """Our parameter name -> HF name for every tensor an HF checkpoint holds."""
    layer_names = dict(_LAYER_NAMES)
    if args.attention_bias:
        layer_names |= {f"attention.{p}.bias": f"self_attn.{p}.bias"
                        for p in ("q_proj", "k_proj", "v_proj")}
    if args.qk_norm:
        layer_names |= {f"attention.{n}.weight": f"self_attn.{n}.weight"
                        for n in ("q_norm", "k_norm")}
    return decoder_hf_names(args, layer_names)
