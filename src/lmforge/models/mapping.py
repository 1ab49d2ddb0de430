"""The rules every family's state-dict mapping follows (``models/<family>/hf.py`` and
Meta's import): every source tensor used exactly once, every target filled with the
expected shape, so a wrong checkpoint fails loudly here rather than as a silently bad
model later; a tied head accepted only as a copy of the embedding."""
from __future__ import annotations

import json
from pathlib import Path

import torch


class HFCheckpointError(ValueError):
    """A model directory, config or state dict cannot be read; the message names the file,
    field or keys at fault."""


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
