"""Hugging Face model directories <-> lmforge's models, for every family: config.json,
the state-dict mapping (names from the family's ``hf.py``), loading and saving
(safetensors, sharded or not). Weights are read from safetensors only, never by plain
unpickling.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from lmforge import fsio
from lmforge.models.common import materialize
from lmforge.models.mapping import (HFCheckpointError, check_finite, check_floating,
                                    drop_tied_head, read_json, remap_state_dict)
from lmforge.models.registry import (args_from_hf_config, build_model, family_of,
                                     hf_config_from_args, hf_names)

__all__ = ["HFCheckpointError", "args_from_hf_config", "hf_config_from_args", "hf_names",
           "from_hf_state_dict", "to_hf_state_dict", "load_hf_model", "save_hf_model"]

HF_HEAD = "lm_head.weight"  # every family's untied output head


# ----------------------------------------------------------------- state-dict mapping

def param_shapes(args) -> dict[str, tuple[int, ...]]:
    """Our parameter name -> shape, read off a meta-device model (costs no memory)."""
    return {k: tuple(v.shape) for k, v in build_model(args, "meta").state_dict().items()}


def from_hf_state_dict(sd: dict, args, source: str = "HF state dict") -> dict:
    """HF names -> ours. Tied: ``output.weight`` is the embedding tensor itself. Buffers
    some checkpoints carry (GPT-J's causal mask) are dropped. A tensor holding NaN or Inf
    is refused, and so is one that is not floating point (every command that loads a model
    directory comes here)."""
    names = hf_names(args)
    shapes = param_shapes(args)
    ignored = family_of(args).ignored_hf_suffixes
    sd = {k: v for k, v in sd.items() if not (ignored and k.endswith(ignored))}
    sd = family_of(args).checkpoint_in(sd, args, source)
    sd = drop_tied_head(sd, HF_HEAD, names["tok_embeddings.weight"], args.tie_embeddings,
                        source)
    out = remap_state_dict(sd, {hf: ours for ours, hf in names.items()},
                           {hf: shapes[ours] for ours, hf in names.items()}, source,
                           hint=_untied_hint(args))
    check_floating(sd, source)  # after the names: sd now holds exactly the model's tensors
    check_finite(sd, source)
    if args.tie_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    return _permute_fused(out, args, to_hf=False)


def to_hf_state_dict(sd: dict, args, source: str = "lmforge state dict") -> dict:
    """Ours -> HF names. Tied: ``output.weight`` is dropped (HF stores the embedding once)."""
    names = hf_names(args)
    shapes = param_shapes(args)
    sd = drop_tied_head(sd, "output.weight", "tok_embeddings.weight", args.tie_embeddings,
                        source)
    hf_sd = remap_state_dict(_permute_fused(sd, args, to_hf=True), names,
                             {ours: shapes[ours] for ours in names}, source)
    return family_of(args).checkpoint_out(hf_sd, args)


def fused_rows(args, name: str, to_hf: bool) -> Optional[torch.Tensor]:
    """The row order that turns the output rows of module ``name`` (its weight, bias or
    LoRA B) from our grouped layout to HF's (``to_hf``) or back; None
    when ``name`` is not a fused projection (``models.family.Fused``)."""
    fused = family_of(args).block(args).fused.get(name.rsplit(".", 1)[-1])
    if fused is None:
        return None
    rows = fused.rows_from_hf()
    return torch.argsort(rows) if to_hf else rows


def _permute_fused(sd: dict, args, to_hf: bool) -> dict:
    """Rows of each fused projection's weight and bias between HF's order (parts one
    after another) and ours (grouped, so a tensor-parallel shard holds every part)."""
    fused = family_of(args).block(args).fused
    if not fused:
        return sd
    # one row order per fused projection, not per layer's tensor
    orders = {leaf: fused_rows(args, leaf, to_hf) for leaf in fused}
    out = {}
    for name, tensor in sd.items():
        rows = orders.get(name.rsplit(".", 1)[0].rsplit(".", 1)[-1])
        out[name] = tensor if rows is None else tensor[rows.to(tensor.device)]
    return out


def _untied_hint(args) -> str:
    if args.tie_embeddings:
        return ""
    return f"; {HF_HEAD} is required because tie_word_embeddings is false"


# --------------------------------------------------------------- model directories

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def read_hf_config(model_dir: str | Path) -> dict:
    root = Path(model_dir)
    if not root.is_dir():
        raise HFCheckpointError(f"{root}: model directory not found")
    return read_json(root / CONFIG_NAME, "a Hugging Face model directory needs config.json")


def read_model_args(model_dir: str | Path):
    """The model's shape (its family's args) from a model directory's config.json; an
    error names that file and the field."""
    root = Path(model_dir)
    args = args_from_hf_config(read_hf_config(root), source=str(root / CONFIG_NAME))
    return family_of(args).with_directory(args, root)


def stop_token_ids(model_dir: str | Path, vocab_size: Optional[int] = None) -> list[int]:
    """The ids generation stops on, as transformers picks them: generation_config.json's
    ``eos_token_id`` (an id or a list), else config.json's. ``vocab_size``: the weights'
    vocabulary, which an id past it is refused against (the model never makes it, so a
    run would never stop on it)."""
    root = Path(model_dir)
    for name in ("generation_config.json", CONFIG_NAME):
        if (root / name).is_file():
            eos = read_json(root / name, "").get("eos_token_id")
            if eos is not None:
                ids = eos if isinstance(eos, list) else [eos]
                if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                           for i in ids):
                    raise HFCheckpointError(f"{root / name}: eos_token_id: {eos!r} is not a "
                                            f"token id or a list of them")
                past = [i for i in ids if vocab_size is not None and i >= vocab_size]
                if past:
                    raise HFCheckpointError(f"{root / name}: eos_token_id: {past[0]} is past "
                                            f"the model's vocabulary of {vocab_size}")
                return list(ids)
    return []


def read_hf_state_dict(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of ``model.safetensors`` or of the shards an index names (CPU). A file
    that leaves the directory (``../``, an absolute path, a link out) is refused."""
    sd: dict[str, torch.Tensor] = {}
    for path in _weight_files(Path(model_dir)):
        sd.update(_load_safetensors(path))
    return sd


def _weight_files(root: Path) -> list[Path]:
    if (root / WEIGHTS_NAME).is_file():
        _check_inside(root, WEIGHTS_NAME, f"{root / WEIGHTS_NAME}")
        return [root / WEIGHTS_NAME]
    if (root / INDEX_NAME).is_file():
        index = read_json(root / INDEX_NAME, "")
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise HFCheckpointError(f"{root / INDEX_NAME}: no weight_map")
        for key, name in weight_map.items():
            _check_inside(root, name, f"{root / INDEX_NAME}: weight_map[{key!r}] = {name!r}")
        return [root / name for name in sorted(set(weight_map.values()))]
    pickled = [p.name for p in root.glob("pytorch_model*.bin")]
    why = (f" (found {pickled[0]}: lmforge reads safetensors only)" if pickled else "")
    raise HFCheckpointError(f"{root}: no {WEIGHTS_NAME} or {INDEX_NAME}{why}")


def _check_inside(root: Path, name, where: str) -> None:
    problem = fsio.outside_dir(root, name)
    if problem:
        raise HFCheckpointError(f"{where}: {problem}; refused")


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    if not path.is_file():
        raise HFCheckpointError(f"{path}: weight shard not found")
    try:
        return load_file(str(path))
    except Exception as e:  # safetensors raises its own error type on a corrupt header
        raise HFCheckpointError(f"{path}: not a readable safetensors file ({e})") from None


def load_hf_model(model_dir: str | Path, device: str | torch.device = "cpu",
                  dtype: Optional[torch.dtype] = None) -> nn.Module:
    """A Hugging Face model directory -> lmforge's model of its family on ``device``.
    ``dtype`` None keeps the dtype the weights are stored in."""
    root = Path(model_dir)
    args = read_model_args(root)
    hf_sd = read_hf_state_dict(root)
    weights = root / (WEIGHTS_NAME if (root / WEIGHTS_NAME).is_file() else INDEX_NAME)
    sd = from_hf_state_dict(hf_sd, args, source=str(weights))
    return load_into_model(args, sd, device, dtype)


def load_into_model(args, sd: dict, device, dtype) -> nn.Module:
    model = build_model(args, "meta").to(dtype=dtype or sd["tok_embeddings.weight"].dtype)
    materialize(model, device, init=False)
    model.load_state_dict(sd, strict=True)
    return model


def save_hf_model(model: nn.Module, out_dir: str | Path, tokenizer=None,
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
