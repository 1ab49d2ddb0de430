"""The rules every family's state-dict mapping follows (``models/<family>/hf.py`` and
Meta's import): every source tensor used exactly once, every target filled with the
expected shape, so a wrong checkpoint fails loudly here rather than as a silently bad
model later; a tied head accepted only as a copy of the embedding."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

import torch


class HFCheckpointError(ValueError):
    """A model directory, config or state dict cannot be read; the message names the file,
    field or keys at fault."""


# ------------------------------------------------------------------ config.json fields

_MISSING = object()


def config_int(cfg: dict, names: str | tuple[str, ...], source: str,
               default: Any = _MISSING) -> Optional[int]:
    """config.json's positive integer ``names`` (a key, or a key and the aliases
    transformers maps to it): ``default`` when absent or null (refused as missing when
    there is none). Refused, naming the key: anything but a positive whole number."""
    name, value = _lookup(cfg, names, source, default)
    if value is None or name is None:
        return value
    whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not whole or value <= 0:
        raise HFCheckpointError(f"{source}: {name}: {value!r} is not a positive integer")
    return int(value)


def config_float(cfg: dict, names: str | tuple[str, ...], source: str,
                 default: Any = _MISSING, positive: bool = True) -> Optional[float]:
    """config.json's finite number ``names`` (> 0 when ``positive``, else >= 0)."""
    name, value = _lookup(cfg, names, source, default)
    if value is None or name is None:
        return value
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or value < 0 or (positive and value == 0):
        kind = "positive" if positive else "non-negative"
        raise HFCheckpointError(f"{source}: {name}: {value!r} is not a {kind} finite "
                                f"number")
    return float(value)


def config_bool(cfg: dict, name: str, source: str, default: bool) -> bool:
    """config.json's true/false ``name`` (a JSON boolean, not the string "false")."""
    _, value = _lookup(cfg, name, source, default)
    if not isinstance(value, bool):
        raise HFCheckpointError(f"{source}: {name}: {value!r} is not true or false")
    return value


def _lookup(cfg: dict, names, source: str, default) -> tuple[Optional[str], Any]:
    """(the key found, its value), or (None, default)."""
    names = (names,) if isinstance(names, str) else names
    for name in names:
        if cfg.get(name) is not None:
            return name, cfg[name]
    if default is _MISSING:
        raise HFCheckpointError(f"{source}: {names[0]} is missing")
    return None, default


def config_layer_types(cfg: dict, n_layers: int, kinds: dict[str, str],
                       source: str) -> Optional[tuple[str, ...]]:
    """config.json's ``layer_types`` as our kinds (``kinds``: transformers' name -> ours),
    one per layer; None when absent. Refused, naming the key: another length or kind."""
    given = cfg.get("layer_types")
    if given is None:
        return None
    if not isinstance(given, list) or len(given) != n_layers or any(
            kind not in kinds for kind in given):
        raise HFCheckpointError(f"{source}: layer_types: expected {n_layers} entries of "
                                f"{' or '.join(kinds)}, got {given!r}")
    return tuple(kinds[kind] for kind in given)


def check_multiple(source: str, name: str, value: int, of_name: str, of: int) -> None:
    """``value`` (config.json's ``name``) is a multiple of ``of`` (its ``of_name``)."""
    if value % of:
        raise HFCheckpointError(f"{source}: {name}: {value} is not a multiple of {of_name} "
                                f"({of})")


# ------------------------------------------------------------------ state dicts

def drop_tied_head(sd: dict, head: str, embed: str, tied: bool, source: str) -> dict:
    """A tied checkpoint may still carry the head; accept it only as a copy of the
    embedding."""
    if not tied or head not in sd:
        return sd
    if embed in sd and not same_tensor(sd[head], sd[embed]):
        raise HFCheckpointError(f"{source}: tie_embeddings is set but {head} differs from "
                                f"{embed}")
    return {k: v for k, v in sd.items() if k != head}


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape:
        return False
    if a.device == b.device and a.data_ptr() == b.data_ptr():
        return True
    return torch.equal(a, b.to(a.device))


def remap_state_dict(sd: dict, names: dict[str, str], shapes: dict[str, tuple],
                     source: str, hint: str = "") -> dict:
    """Rename ``sd`` by ``names`` (source -> target); every source key used exactly once,
    every expected key present with ``shapes[source key]``."""
    missing = [k for k in names if k not in sd]
    unexpected = [k for k in sd if k not in names]
    misshaped = [f"{k} {tuple(sd[k].shape)} (expected {shapes[k]})"
                 for k in names if k in sd and tuple(sd[k].shape) != shapes[k]]
    problems = [f"{label}: {_truncate(keys)}" for label, keys in (
        ("missing", missing), ("unexpected", unexpected), ("misshaped", misshaped)) if keys]
    if problems:
        extra = hint if any(k.startswith(("lm_head", "output")) for k in missing) else ""
        raise HFCheckpointError(f"{source}: " + "; ".join(problems) + extra)
    return {target: sd[src] for src, target in names.items()}


def check_floating(sd: dict, source: str) -> None:
    """Refuse a tensor that is not floating point, naming it and its dtype: a model's
    weights are (an integer embedding or norm cannot take the model's dtype)."""
    name = next((k for k, v in sd.items() if not v.is_floating_point()), None)
    if name is not None:
        raise HFCheckpointError(f"{source}: tensor {name} is {sd[name].dtype}; a model's "
                                f"weights are floating point")


def check_finite(sd: dict, source: str) -> None:
    """Refuse a floating-point tensor holding NaN or Inf, naming it: a model computing with
    one generates, evaluates and fine-tunes nonsense."""
    name = first_nonfinite(sd)
    if name is not None:
        raise HFCheckpointError(f"{source}: tensor {name} holds NaN or Inf values")


def first_nonfinite(sd: dict) -> Optional[str]:
    """The name of the first floating-point tensor holding NaN or Inf, None if none does.
    A sum per tensor (several GB/s, no copy) finds them; a non-finite sum is confirmed
    element by element, in chunks, since a 16-bit sum can overflow on finite values."""
    for name, tensor in sd.items():
        if not tensor.is_floating_point() or tensor.is_meta:
            continue
        if not torch.isfinite(tensor.sum()) and not _all_finite(tensor):
            return name
    return None


def _all_finite(tensor: torch.Tensor, chunk: int = 1 << 22) -> bool:
    return all(bool(torch.isfinite(part).all()) for part in tensor.reshape(-1).split(chunk))


def _truncate(keys: list[str], limit: int = 6) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")


def read_json(path: Path, why_needed: str) -> dict:
    if not path.is_file():
        raise HFCheckpointError(f"{path}: not found" + (f" ({why_needed})" if why_needed else ""))
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HFCheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise HFCheckpointError(f"{path}: top level must be a JSON object")
    return data


# ------------------------------------------------------- what decoder families share

def decoder_config_fields(args, architecture: str, model_type: str) -> dict:
    """The config.json fields every decoder-only family in transformers' Llama lineage
    writes alike (Llama, Mistral, Qwen, Phi-3, Gemma 3): names, shape, norm epsilon,
    RoPE base, tying, initialisation; each family adds its own on top."""
    return {
        "architectures": [architecture], "model_type": model_type,
        "hidden_size": args.dim, "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads, "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len, "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta, "tie_word_embeddings": args.tie_embeddings,
        "initializer_range": args.init_std, "attention_dropout": 0.0, "use_cache": True,
        "torch_dtype": "float32",
    }


def decoder_hf_names(args, layer_names: dict[str, str]) -> dict[str, str]:
    """Our parameter name -> HF name for every tensor an HF checkpoint of such a family
    holds: ``layer_names`` (ours -> theirs, within a block) for each block, under
    ``model.``; the head as ``lm_head`` unless tied (a tied checkpoint has none)."""
    names = {"tok_embeddings.weight": "model.embed_tokens.weight",
             "norm.weight": "model.norm.weight"}
    for i in range(args.n_layers):
        for ours, theirs in layer_names.items():
            names[f"layers.{i}.{ours}"] = f"model.layers.{i}.{theirs}"
    if not args.tie_embeddings:
        names["output.weight"] = "lm_head.weight"
    return names


def write_gguf_shape(writer, args, rope_dims: int) -> None:
    """The shape keys every decoder family writes for llama.cpp (a ``gguf.GGUFWriter``):
    context, width, depth, MLP width, heads, RoPE base and dimensions, norm epsilon."""
    writer.add_context_length(args.max_seq_len)
    writer.add_embedding_length(args.dim)
    writer.add_block_count(args.n_layers)
    writer.add_feed_forward_length(args.ffn_dim)
    writer.add_head_count(args.n_heads)
    writer.add_head_count_kv(args.n_kv_heads)
    writer.add_rope_freq_base(args.rope_theta)
    writer.add_layer_norm_rms_eps(args.norm_eps)
    writer.add_rope_dimension_count(rope_dims)


def gguf_tensor_name(hf_name: str, name_map) -> str:
    """The GGUF name of a Hugging Face tensor, from the gguf package's ``TensorNameMap``."""
    name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if name is None:
        raise ValueError(f"{hf_name}: no GGUF name for it in the gguf package's table")
    return name
