"""Hugging Face's GPT-J (``GPTJForCausalLM``) <-> lmforge's ``GPTJ``: config.json fields and
parameter names (a pure mapping: HF's q/k already use the interleaved rotary layout we
compute with, so no tensor is permuted)."""
from __future__ import annotations

from lmforge.models.gptj.model import GPTJArgs
from lmforge.models.mapping import (HFCheckpointError, check_multiple, config_bool,
                                    config_float, config_int)

_LAYER_NAMES = {  # ours -> Hugging Face, inside layers.{i} / transformer.h.{i}
    "attention_norm.weight": "ln_1.weight",
    "attention_norm.bias": "ln_1.bias",
    "attention.q_proj.weight": "attn.q_proj.weight",
    "attention.k_proj.weight": "attn.k_proj.weight",
    "attention.v_proj.weight": "attn.v_proj.weight",
    "attention.out_proj.weight": "attn.out_proj.weight",
    "feed_forward.fc_in.weight": "mlp.fc_in.weight",
    "feed_forward.fc_in.bias": "mlp.fc_in.bias",
    "feed_forward.fc_out.weight": "mlp.fc_out.weight",
    "feed_forward.fc_out.bias": "mlp.fc_out.bias",
}
# Checkpoints written by transformers < 4.30 (EleutherAI/gpt-j-6b among them) also hold
# each layer's causal-mask buffers; they are not weights.
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")

_DEFAULTS = {  # transformers' GPTJConfig defaults for fields a config may omit
    "n_positions": 2048, "layer_norm_epsilon": 1e-5, "tie_word_embeddings": False,
    "initializer_range": 0.02, "activation_function": "gelu_new",
}
# GELU, tanh approximation, under the names transformers gives it.
_TANH_GELU = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


def args_from_hf_config(cfg: dict, source: str = "config.json") -> GPTJArgs:
    """A transformers GPT-J config dict -> ``GPTJArgs``; refuses, naming the field, what
    our model would compute differently and shapes it cannot have. A size may be under
    GPT-J's own key or the generic alias transformers maps to it (n_embd, hidden_size)."""
    activation = cfg.get("activation_function") or _DEFAULTS["activation_function"]
    if activation not in _TANH_GELU:
        raise HFCheckpointError(f"{source}: activation_function = {activation!r} is not "
                                f"supported for model_type 'gptj' (lmforge needs "
                                f"'gelu_new')")
    dim = config_int(cfg, ("n_embd", "hidden_size"), source)
    n_heads = config_int(cfg, ("n_head", "num_attention_heads"), source)
    check_multiple(source, "n_embd", dim, "n_head", n_heads)
    rotary_dim = config_int(cfg, "rotary_dim", source, default=None)
    if rotary_dim is not None and (rotary_dim > dim // n_heads or rotary_dim % 2):
        raise HFCheckpointError(f"{source}: rotary_dim: {rotary_dim} must be even and at "
                                f"most the head size {dim // n_heads}")
    return GPTJArgs(
        dim=dim, n_layers=config_int(cfg, ("n_layer", "num_hidden_layers"), source),
        n_heads=n_heads, n_kv_heads=n_heads, vocab_size=config_int(cfg, "vocab_size", source),
        ffn_dim=config_int(cfg, "n_inner", source, default=4 * dim),
        max_seq_len=config_int(cfg, "n_positions", source, _DEFAULTS["n_positions"]),
        norm_eps=config_float(cfg, "layer_norm_epsilon", source,
                              _DEFAULTS["layer_norm_epsilon"]),
        tie_embeddings=config_bool(cfg, "tie_word_embeddings", source,
                                   _DEFAULTS["tie_word_embeddings"]),
        init_std=config_float(cfg, "initializer_range", source,
                              _DEFAULTS["initializer_range"], positive=False),
        rotary_dim=rotary_dim)


def hf_config_from_args(args: GPTJArgs) -> dict:
    """``GPTJArgs`` -> a config.json dict that transformers loads."""
    return {
        "architectures": ["GPTJForCausalLM"], "model_type": "gptj",
        "n_embd": args.dim, "n_layer": args.n_layers, "n_head": args.n_heads,
        "n_inner": args.ffn_dim, "rotary_dim": args.rotary_features,  # transformers 5 needs an int
        "vocab_size": args.vocab_size, "n_positions": args.max_seq_len,
        "layer_norm_epsilon": args.norm_eps, "activation_function": "gelu_new",
        "tie_word_embeddings": args.tie_embeddings, "initializer_range": args.init_std,
        "attn_pdrop": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0, "use_cache": True,
        "torch_dtype": "float32",
    }


def hf_names(args: GPTJArgs) -> dict[str, str]:
    """Our parameter name -> HF name for every tensor an HF checkpoint holds."""
    names = {"tok_embeddings.weight": "transformer.wte.weight",
             "norm.weight": "transformer.ln_f.weight", "norm.bias": "transformer.ln_f.bias",
             "output.bias": "lm_head.bias"}
    for i in range(args.n_layers):
        for ours, theirs in _LAYER_NAMES.items():
            names[f"layers.{i}.{ours}"] = f"transformer.h.{i}.{theirs}"
    if not args.tie_embeddings:  # a tied HF checkpoint has no lm_head.weight
        names["output.weight"] = "lm_head.weight"
    return names
