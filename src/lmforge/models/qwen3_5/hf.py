"""Hugging Face's Qwen3.5 language model (``qwen3_5_text``, ``Qwen3_5ForCausalLM``, or
the language model of a ``Qwen3_5ForConditionalGeneration``: ``vision.py``) <->
lmforge's ``Hybrid``: config.json fields and parameter names. The full-attention layers'
names are Qwen3's; a linear layer's ``attention`` is transformers' ``linear_attn``, the
same leaf names."""
from __future__ import annotations

from lmforge.config import show
from lmforge.models.llama import hf as llama_hf
from lmforge.models.mapping import (HFCheckpointError, check_multiple, config_float,
                                    config_int, decoder_config_fields, decoder_hf_names)
from lmforge.models.qwen3_5 import vision
from lmforge.models.qwen3_5.model import FULL, LAYER_TYPES, LINEAR, HybridArgs

ARCHITECTURE = "Qwen3_5ForCausalLM"
_DEFAULTS = {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
             "partial_rotary_factor": 0.25, "linear_conv_kernel_dim": 4,
             "linear_key_head_dim": 128, "linear_value_head_dim": 128,
             "linear_num_key_heads": 16, "linear_num_value_heads": 32,
             "full_attention_interval": 4}
_FULL_NAMES = {f"attention.{n}.weight": f"self_attn.{n}.weight"
               for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
_LINEAR_NAMES = {f"attention.{n}": f"linear_attn.{n}" for n in (
    "in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight",
    "conv1d.weight", "dt_bias", "A_log", "norm.weight", "out_proj.weight")}
_SHARED_NAMES = {  # the MLP and the block's norms, on every layer
    "feed_forward.gate_proj.weight": "mlp.gate_proj.weight",
    "feed_forward.up_proj.weight": "mlp.up_proj.weight",
    "feed_forward.down_proj.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}


def args_from_hf_config(cfg: dict, source: str = "config.json") -> HybridArgs:
    """A transformers Qwen3.5 text config dict -> ``HybridArgs``; refused, naming the
    field, whatever our model would compute otherwise."""
    cfg, image_text = vision.text_config(cfg, source)
    if image_text:
        source += ": text_config"
    if cfg.get("attention_bias"):
        raise HFCheckpointError(f"{source}: attention_bias: true is not supported (Qwen3.5's "
                                f"attention has no biases)")
    if cfg.get("hidden_act", "silu") != "silu":
        raise HFCheckpointError(f"{source}: hidden_act: {cfg['hidden_act']!r} is not "
                                f"supported (only silu)")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise HFCheckpointError(f"{source}: rope_parameters: {rope!r} is not an object")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise HFCheckpointError(f"{source}: rope_parameters: rope_type {kind!r} is not "
                                f"supported for qwen3_5 (only default)")
    dim, n_heads, n_kv_heads, explicit = llama_hf._heads(cfg, source)
    n_layers = config_int(cfg, "num_hidden_layers", source)
    d = _DEFAULTS
    args = HybridArgs(
        dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
        vocab_size=config_int(cfg, "vocab_size", source),
        ffn_dim=config_int(cfg, "intermediate_size", source),
        max_seq_len=config_int(cfg, "max_position_embeddings", source,
                               d["max_position_embeddings"]),
        rope_theta=llama_hf.rope_theta(cfg, source),
        norm_eps=config_float(cfg, "rms_norm_eps", source, d["rms_norm_eps"]),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        init_std=config_float(cfg, "initializer_range", source, 0.02, positive=False),
        explicit_head_dim=explicit, qk_norm=True,
        layer_types=_layer_types(cfg, n_layers, source),
        partial_rotary_factor=config_float(
            rope if "partial_rotary_factor" in rope else cfg, "partial_rotary_factor",
            source, d["partial_rotary_factor"]),
        linear_key_heads=config_int(cfg, "linear_num_key_heads", source,
                                    d["linear_num_key_heads"]),
        linear_value_heads=config_int(cfg, "linear_num_value_heads", source,
                                      d["linear_num_value_heads"]),
        linear_key_head_dim=config_int(cfg, "linear_key_head_dim", source,
                                       d["linear_key_head_dim"]),
        linear_value_head_dim=config_int(cfg, "linear_value_head_dim", source,
                                         d["linear_value_head_dim"]),
        linear_conv_kernel=config_int(cfg, "linear_conv_kernel_dim", source,
                                      d["linear_conv_kernel_dim"]),
        vision_from=vision.THIS_DIRECTORY if image_text else None)
    _check_splits(args, source)
    return args


def _check_splits(args: HybridArgs, source: str) -> None:
    """The heads a linear layer's convolution and rule can split (its channels are each
    key head's q and k, then the v of the value heads it serves: a whole group per key
    head), and a rotary share RoPE can take, named as config.json names them (the
    presets' ``check_args`` names them as model.* keys)."""
    check_multiple(source, "linear_num_value_heads", args.linear_value_heads,
                   "linear_num_key_heads", args.linear_key_heads)
    if args.partial_rotary_factor > 1 or args.rotary_dim % 2 or args.rotary_dim < 2:
        raise HFCheckpointError(
            f"{source}: partial_rotary_factor: {args.partial_rotary_factor!r} of head_dim "
            f"{args.head_dim} rotates {args.head_dim * args.partial_rotary_factor:g} "
            f"features; RoPE needs an even number, at least 2, at most head_dim")


def _layer_types(cfg: dict, n_layers: int, source: str) -> tuple[str, ...]:
    """``layer_types`` as given, else transformers' rule from ``full_attention_interval``
    (every interval-th layer full)."""
    given = cfg.get("layer_types")
    if given is None:
        every = config_int(cfg, "full_attention_interval", source,
                           _DEFAULTS["full_attention_interval"])
        return tuple(FULL if (i + 1) % every == 0 else LINEAR for i in range(n_layers))
    if not isinstance(given, list):
        raise HFCheckpointError(f"{source}: layer_types: {show(given)} is not a list "
                                f"(one entry per layer)")
    if len(given) != n_layers:
        raise HFCheckpointError(f"{source}: layer_types: {len(given)} entries for "
                                f"num_hidden_layers = {n_layers}; one per layer")
    bad = [t for t in given if t not in LAYER_TYPES]
    if bad:
        raise HFCheckpointError(f"{source}: layer_types: {show(bad[0])} is not one of "
                                f"{', '.join(LAYER_TYPES)} (entry {given.index(bad[0])})")
    return tuple(given)


def hf_config_from_args(args: HybridArgs) -> dict:
    """``HybridArgs`` -> a config.json dict that transformers 5 loads."""
    cfg = decoder_config_fields(args, ARCHITECTURE, "qwen3_5_text")
    del cfg["rope_theta"]
    if args.vision_from is not None:  # (the image-text model's own, written back)
        del cfg["architectures"], cfg["torch_dtype"]
    return vision.conditional_config(args, cfg | {
        "head_dim": args.head_dim, "hidden_act": "silu", "attention_bias": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta,
                            "partial_rotary_factor": args.partial_rotary_factor},
        "layer_types": list(args.layer_types),
        "linear_num_key_heads": args.linear_key_heads,
        "linear_num_value_heads": args.linear_value_heads,
        "linear_key_head_dim": args.linear_key_head_dim,
        "linear_value_head_dim": args.linear_value_head_dim,
        "linear_conv_kernel_dim": args.linear_conv_kernel,
    })


def hf_names(args: HybridArgs) -> dict[str, str]:
    """Our parameter name -> HF name for every tensor a Qwen3.5 text checkpoint holds."""
    names = decoder_hf_names(args, _SHARED_NAMES)
    for i in range(args.n_layers):
        mixer = _LINEAR_NAMES if args.is_linear(i) else _FULL_NAMES
        names |= {f"layers.{i}.{ours}": f"model.layers.{i}.{theirs}"
                  for ours, theirs in mixer.items()}
    return {ours: vision.hf_name(theirs, args) for ours, theirs in names.items()}


def checkpoint_in(sd: dict, args: HybridArgs, source: str) -> dict:
    """An image-text checkpoint's tensors without its vision tower (``vision.py``)."""
    return vision.drop_vision(sd, args)


def checkpoint_out(sd: dict, args: HybridArgs) -> dict:
    """The language model's tensors, and an image-text source's vision tower again."""
    return vision.add_vision(sd, args)
