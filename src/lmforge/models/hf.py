"""Hugging Face model directories <-> lmforge's ``Llama``: config.json, the state-dict
mapping, loading and saving (safetensors, sharded or not).

The mapping is a pure function over state dicts, names only (our q/k use HF's rotate-half
RoPE layout; Meta's interleaved layout is ``models/meta.py``). Every source tensor must be
used exactly once and every target filled with the expected shape, so a wrong checkpoint
fails loudly here rather than as a silently bad model later. Weights are read from
safetensors only, never by plain unpickling.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from lmforge import fsio
from lmforge.models.llama import Llama, LlamaArgs, RopeScaling, build_llama, materialize


class HFCheckpointError(ValueError):
    """A model directory, config or state dict cannot be read; the message names the file,
    field or keys at fault."""


# ------------------------------------------------------------------------ config.json

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
class Family:
    """What one HF ``model_type`` is, as flags on lmforge's Llama."""
    architecture: str
    attention_bias: bool = False  # q/k/v biases always present (Qwen2's modeling code)
    qk_norm: bool = False
    window_key: Optional[str] = None  # the config key that turns a sliding window on


FAMILIES = {
    "llama": Family("LlamaForCausalLM"),
    # Mistral: a window whenever config.json's sliding_window is set (transformers' rule).
    "mistral": Family("MistralForCausalLM", window_key="sliding_window"),
    # Qwen2/Qwen3: a window only with use_sliding_window, and then only on some layers
    # (max_window_layers), which our one-window model cannot express: refused.
    "qwen2": Family("Qwen2ForCausalLM", attention_bias=True, window_key="use_sliding_window"),
    "qwen3": Family("Qwen3ForCausalLM", qk_norm=True, window_key="use_sliding_window"),
}

# config.json fields each family must leave at the value our model computes with (the
# default when absent). Qwen2 has no attention_bias key: its q/k/v biases are fixed.
_REQUIRED = {"llama": {"attention_bias": False, "mlp_bias": False},
             "mistral": {}, "qwen2": {}, "qwen3": {"attention_bias": False},
             "all": {"hidden_act": "silu"}}


def family_of(cfg: dict, source: str) -> str:
    model_type = cfg.get("model_type")
    if model_type not in FAMILIES:
        raise HFCheckpointError(f"{source}: model_type = {model_type!r} is not supported "
                                f"(lmforge loads {', '.join(sorted(FAMILIES))})")
    for name, wanted in (_REQUIRED["all"] | _REQUIRED[model_type]).items():
        if cfg.get(name, wanted) != wanted:
            raise HFCheckpointError(f"{source}: {name} = {cfg[name]!r} is not supported "
                                    f"for model_type {model_type!r} (lmforge needs "
                                    f"{wanted!r})")
    return model_type


def _sliding_window(cfg: dict, family: str, source: str) -> Optional[int]:
    key = FAMILIES[family].window_key
    if key is None or not cfg.get(key):
        return None
    if key != "sliding_window" or any(
            t != "full_attention" for t in cfg.get("layer_types") or []):
        raise HFCheckpointError(f"{source}: {key} = {cfg[key]!r} is not supported for "
                                f"model_type {family!r} (lmforge applies one window to "
                                f"every layer; per-layer windows are not implemented)")
    return int(cfg["sliding_window"])


def _head_dim(cfg: dict, dim: int, n_heads: int, source: str) -> Optional[int]:
    """The explicit head_dim, or None when it is dim / n_heads anyway."""
    head_dim = cfg.get("head_dim")
    if head_dim is None or (dim % n_heads == 0 and head_dim == dim // n_heads):
        if dim % n_heads:
            raise HFCheckpointError(f"{source}: hidden_size {dim} is not a multiple of "
                                    f"num_attention_heads {n_heads} and no head_dim is set")
        return None
    return int(head_dim)


def args_from_hf_config(cfg: dict, source: str = "config.json") -> LlamaArgs:
    """A transformers Llama, Mistral, Qwen2 or Qwen3 config dict (v4 or v5 layout) ->
    ``LlamaArgs``. Refuses, naming the field, anything our model would compute
    differently."""
    def field(name):
        if cfg.get(name) is None:
            raise HFCheckpointError(f"{source}: {name} is missing")
        return cfg[name]

    family = family_of(cfg, source)
    dim, n_heads = int(field("hidden_size")), int(field("num_attention_heads"))

    def get(name):
        return cfg[name] if cfg.get(name) is not None else _LLAMA_DEFAULTS[name]

    return LlamaArgs(
        dim=dim, n_layers=int(field("num_hidden_layers")), n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        vocab_size=int(field("vocab_size")), ffn_dim=int(field("intermediate_size")),
        max_seq_len=int(get("max_position_embeddings")),
        rope_theta=float(_rope_theta(cfg)), rope_scaling=_rope_scaling(cfg, source),
        norm_eps=float(get("rms_norm_eps")), tie_embeddings=bool(get("tie_word_embeddings")),
        init_std=float(get("initializer_range")), family=family,
        explicit_head_dim=_head_dim(cfg, dim, n_heads, source),
        attention_bias=FAMILIES[family].attention_bias, qk_norm=FAMILIES[family].qk_norm,
        sliding_window=_sliding_window(cfg, family, source))


def _rope_theta(cfg: dict) -> float:
    # transformers 5 moved rope_theta into rope_parameters; 4.x keeps it at the top level.
    if cfg.get("rope_theta") is not None:
        return cfg["rope_theta"]
    return (cfg.get("rope_parameters") or {}).get("rope_theta", _LLAMA_DEFAULTS["rope_theta"])


def _rope_scaling(cfg: dict, source: str) -> Optional[RopeScaling]:
    name = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    rope = cfg.get(name) or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise HFCheckpointError(f"{source}: {name}.rope_type = {kind!r} is not supported "
                                f"(lmforge supports 'default' and 'llama3')")
    try:
        return RopeScaling(float(rope["factor"]), float(rope["low_freq_factor"]),
                           float(rope["high_freq_factor"]),
                           int(rope["original_max_position_embeddings"]))
    except KeyError as e:
        raise HFCheckpointError(f"{source}: {name}.{e.args[0]} is missing") from None


def hf_config_from_args(args: LlamaArgs, **extra) -> dict:
    """``LlamaArgs`` -> a config.json dict that transformers 4.45+ and 5.x load. ``extra``
    adds or overrides fields (``torch_dtype``, ``bos_token_id``, ...); None ids are left
    out."""
    s = args.rope_scaling
    rope_scaling = None if s is None else {
        "rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
        "high_freq_factor": s.high_freq_factor,
        "original_max_position_embeddings": s.original_max_position_embeddings}
    cfg = {
        "architectures": [FAMILIES[args.family].architecture], "model_type": args.family,
        "hidden_size": args.dim, "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim,
        "vocab_size": args.vocab_size, "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps, "rope_theta": args.rope_theta,
        "rope_scaling": rope_scaling, "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu", "attention_bias": args.attention_bias,
        "attention_dropout": 0.0,
        "mlp_bias": False, "initializer_range": args.init_std, "use_cache": True,
        "torch_dtype": "float32",
    }
    cfg.update(_family_fields(args))
    cfg.update(extra)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if cfg.get(name, 0) is None:
            del cfg[name]
    return cfg


def _family_fields(args: LlamaArgs) -> dict:
    window_key = FAMILIES[args.family].window_key
    if window_key == "sliding_window":
        return {"sliding_window": args.sliding_window}
    if window_key == "use_sliding_window":
        return {"use_sliding_window": False, "sliding_window": None}
    return {}


# ----------------------------------------------------------------- state-dict mapping

def hf_names(args: LlamaArgs) -> dict[str, str]:
    """Our parameter name -> HF name for every tensor an HF checkpoint holds."""
    names = {"tok_embeddings.weight": "model.embed_tokens.weight",
             "norm.weight": "model.norm.weight"}
    layer_names = dict(_LAYER_NAMES)
    if args.attention_bias:
        layer_names |= {f"attention.{p}.bias": f"self_attn.{p}.bias"
                        for p in ("q_proj", "k_proj", "v_proj")}
    if args.qk_norm:
        layer_names |= {f"attention.{n}.weight": f"self_attn.{n}.weight"
                        for n in ("q_norm", "k_norm")}
    for i in range(args.n_layers):
        for ours, theirs in layer_names.items():
            names[f"layers.{i}.{ours}"] = f"model.layers.{i}.{theirs}"
    if not args.tie_embeddings:  # a tied HF checkpoint has no lm_head
        names["output.weight"] = "lm_head.weight"
    return names


def param_shapes(args: LlamaArgs) -> dict[str, tuple[int, ...]]:
    """Our parameter name -> shape, read off a meta-device model (costs no memory)."""
    return {k: tuple(v.shape) for k, v in build_llama(args, "meta").state_dict().items()}


def from_hf_state_dict(sd: dict, args: LlamaArgs, source: str = "HF state dict") -> dict:
    """HF names -> ours. Tied: ``output.weight`` is the embedding tensor itself."""
    names = hf_names(args)
    shapes = param_shapes(args)
    sd = drop_tied_head(sd, "lm_head.weight", "model.embed_tokens.weight", args, source)
    out = remap_state_dict(sd, {hf: ours for ours, hf in names.items()},
                           {hf: shapes[ours] for ours, hf in names.items()}, source,
                           hint=_untied_hint(args))
    if args.tie_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def to_hf_state_dict(sd: dict, args: LlamaArgs, source: str = "lmforge state dict") -> dict:
    """Ours -> HF names. Tied: ``output.weight`` is dropped (HF stores the embedding once)."""
    names = hf_names(args)
    shapes = param_shapes(args)
    sd = drop_tied_head(sd, "output.weight", "tok_embeddings.weight", args, source)
    return remap_state_dict(sd, names, {ours: shapes[ours] for ours in names}, source)


def _untied_hint(args: LlamaArgs) -> str:
    if args.tie_embeddings:
        return ""
    return ("; lm_head.weight is required because tie_word_embeddings is false")


def drop_tied_head(sd: dict, head: str, embed: str, args: LlamaArgs, source: str) -> dict:
    """A tied checkpoint may still carry the head; accept it only as a copy of the
    embedding."""
    if not args.tie_embeddings or head not in sd:
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


def _truncate(keys: list[str], limit: int = 6) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")


# --------------------------------------------------------------- model directories

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def read_hf_config(model_dir: str | Path) -> dict:
    root = Path(model_dir)
    if not root.is_dir():
        raise HFCheckpointError(f"{root}: model directory not found")
    return read_json(root / CONFIG_NAME, "a Hugging Face model directory needs config.json")


def stop_token_ids(model_dir: str | Path) -> list[int]:
    """The ids generation stops on, as transformers picks them: generation_config.json's
    ``eos_token_id`` (an id or a list), else config.json's."""
    root = Path(model_dir)
    for name in ("generation_config.json", CONFIG_NAME):
        if (root / name).is_file():
            eos = read_json(root / name, "").get("eos_token_id")
            if eos is not None:
                return [int(i) for i in (eos if isinstance(eos, list) else [eos])]
    return []


def read_hf_state_dict(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of ``model.safetensors`` or of the shards an index names (CPU)."""
    root = Path(model_dir)
    if (root / WEIGHTS_NAME).is_file():
        files = [root / WEIGHTS_NAME]
    elif (root / INDEX_NAME).is_file():
        index = read_json(root / INDEX_NAME, "")
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise HFCheckpointError(f"{root / INDEX_NAME}: no weight_map")
        files = [root / name for name in sorted(set(weight_map.values()))]
    else:
        pickled = [p.name for p in root.glob("pytorch_model*.bin")]
        why = (f" (found {pickled[0]}: lmforge reads safetensors only)" if pickled else "")
        raise HFCheckpointError(f"{root}: no {WEIGHTS_NAME} or {INDEX_NAME}{why}")
    sd: dict[str, torch.Tensor] = {}
    for path in files:
        sd.update(_load_safetensors(path))
    return sd


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    if not path.is_file():
        raise HFCheckpointError(f"{path}: weight shard not found")
    try:
        return load_file(str(path))
    except Exception as e:  # safetensors raises its own error type on a corrupt header
        raise HFCheckpointError(f"{path}: not a readable safetensors file ({e})") from None


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


def load_hf_model(model_dir: str | Path, device: str | torch.device = "cpu",
                  dtype: Optional[torch.dtype] = None) -> Llama:
    """A Hugging Face Llama directory -> ``Llama`` on ``device``. ``dtype`` None keeps the
    dtype the weights are stored in."""
    root = Path(model_dir)
    args = args_from_hf_config(read_hf_config(root), source=str(root / CONFIG_NAME))
    hf_sd = read_hf_state_dict(root)
    weights = root / (WEIGHTS_NAME if (root / WEIGHTS_NAME).is_file() else INDEX_NAME)
    sd = from_hf_state_dict(hf_sd, args, source=str(weights))
    return load_into_model(args, sd, device, dtype)


def load_into_model(args: LlamaArgs, sd: dict, device, dtype) -> Llama:
    model = build_llama(args, "meta").to(dtype=dtype or sd["tok_embeddings.weight"].dtype)
    materialize(model, device, init=False)
    model.load_state_dict(sd, strict=True)
    return model


def save_hf_model(model: Llama, out_dir: str | Path, tokenizer=None,
                  max_shard_bytes: int = 5 * 1000**3, dtype: Optional[torch.dtype] = None,
                  generation_config: Optional[dict] = None) -> Path:
    """Write a directory ``transformers.AutoModelForCausalLM.from_pretrained`` loads.

    Written with ``fsio.atomic_dir`` (a temporary sibling renamed into place), so a
    reader never sees half a model. An existing ``out_dir`` is replaced only when it is
    empty or a model directory (has config.json)."""
    out = Path(out_dir)
    _check_replaceable(out)
    sd = to_hf_state_dict(model.state_dict(), model.args)
    sd = {k: v.detach().to("cpu", dtype or v.dtype).contiguous() for k, v in sd.items()}
    ids = {} if tokenizer is None else {
        "bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}
    stored_dtype = str(next(iter(sd.values())).dtype).removeprefix("torch.")
    config = hf_config_from_args(model.args, torch_dtype=stored_dtype, **ids)
    generation = {k: v for k, v in ids.items() if v is not None} | (generation_config or {})

    with fsio.atomic_dir(out) as tmp:
        _write_json(tmp / CONFIG_NAME, config)
        _write_json(tmp / "generation_config.json", generation)
        write_safetensors_shards(sd, tmp, max_shard_bytes)
        if tokenizer is not None:
            tokenizer.save(tmp)
    return out


def write_safetensors_shards(sd: dict[str, torch.Tensor], out_dir: Path,
                             max_shard_bytes: int) -> list[str]:
    """``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` + index when the
    tensors exceed ``max_shard_bytes`` (a tensor larger than that gets a shard alone)."""
    from safetensors.torch import save_file
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in sd.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        names = [WEIGHTS_NAME]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                 for i in range(len(shards))]
        total = sum(t.numel() * t.element_size() for t in sd.values())
        weight_map = {k: name for name, shard in zip(names, shards) for k in shard}
        _write_json(out_dir / INDEX_NAME,
                    {"metadata": {"total_size": total}, "weight_map": weight_map})
    for name, shard in zip(names, shards):
        save_file(shard, str(out_dir / name), metadata={"format": "pt"})
    return names


def _check_replaceable(out: Path) -> None:
    if out.exists() and not (out.is_dir() and (
            (out / CONFIG_NAME).is_file() or not any(out.iterdir()))):
        raise HFCheckpointError(f"{out}: exists and is not a model directory; "
                                f"refusing to replace it")


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
