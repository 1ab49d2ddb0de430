"""Which linear layers get LoRA: the seven projection names and the one rule that reads
``lora.targets``. The trainer's LoRA swap, QLoRA's quantization, adapter save/load (peft's
``target_modules``), the FLOPs count and the memory estimate all resolve targets here.

The rule, for each entry of ``lora.targets`` (a list, or one string), case and
surrounding spaces ignored:

- a projection name: ``q_proj k_proj v_proj o_proj gate_proj up_proj down_proj``;
- a short name of one: ``q k v o gate up down``, or Meta's ``wq wk wv wo`` and
  ``w1`` (gate), ``w3`` (up), ``w2`` (down);
- a module path ending in one of those (``attention.q_proj``, ``self_attn.q_proj``,
  ``mlp.down_proj``, ``feed_forward.w2``): that projection, in every layer;
- a group: ``all-linear`` (all seven, as peft's: not the embedding or the output head),
  ``attention`` (q, k, v, o), ``mlp`` (gate, up, down); spelled also ``all_linear``,
  ``attn`` / ``self_attn``, ``ffn`` / ``feed_forward``.

Refused with an error naming ``lora.targets``: anything else, an empty list, ``all``
(it could be read to include the embedding and the head), and a path through one layer
(``layers.0.attention.q_proj``: targets apply to every layer). The result is the
projection names in model order, each once.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from lmforge.config import QUANTIZE_FORMATS, ConfigError, LoraConfig

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION_PROJECTIONS = PROJECTIONS[:4]
MLP_PROJECTIONS = PROJECTIONS[4:]

_SHORT_NAMES = {
    "q": "q_proj", "wq": "q_proj", "k": "k_proj", "wk": "k_proj", "v": "v_proj",
    "wv": "v_proj", "o": "o_proj", "wo": "o_proj", "gate": "gate_proj", "w1": "gate_proj",
    "up": "up_proj", "w3": "up_proj", "down": "down_proj", "w2": "down_proj",
}
_GROUPS = {
    "all-linear": PROJECTIONS, "all_linear": PROJECTIONS,
    "attention": ATTENTION_PROJECTIONS, "attn": ATTENTION_PROJECTIONS,
    "self_attn": ATTENTION_PROJECTIONS,
    "mlp": MLP_PROJECTIONS, "ffn": MLP_PROJECTIONS, "feed_forward": MLP_PROJECTIONS,
}
_KNOWN = (f"known: {', '.join(PROJECTIONS)}, their short names (q, wq, ..., w1/w2/w3), "
          f"paths ending in one, or the groups all-linear, attention, mlp")


def resolve_targets(targets: Any) -> tuple[str, ...]:
    """``lora.targets`` -> projection names in model order (see the module docstring)."""
    items = [targets] if isinstance(targets, str) else targets
    if not isinstance(items, (list, tuple)) or not items:
        raise ConfigError(f"lora.targets: expected a list of module names or 'all-linear', "
                          f"got {targets!r}")
    found: set[str] = set()
    for item in items:
        found.update(_resolve_one(item))
    return tuple(p for p in PROJECTIONS if p in found)


def _resolve_one(item: Any) -> tuple[str, ...]:
    key = str(item).strip().lower()
    if key in _GROUPS:
        return _GROUPS[key]
    path = key.split(".")
    if any(part.isdigit() for part in path):
        raise ConfigError(f"lora.targets: {item!r} names one layer; targets apply to every "
                          f"layer (write {path[-1]!r})")
    leaf = _SHORT_NAMES.get(path[-1], path[-1])
    if leaf not in PROJECTIONS:
        raise ConfigError(f"lora.targets: unknown module {item!r} ({_KNOWN})")
    return (leaf,)


def target_modules(module_names: Iterable[str]) -> list[str]:
    """peft's ``target_modules`` for adapters on these (full) module names: their leaf
    names, sorted; peft matches every module whose name ends with one. For the seven
    projections our leaf names and Hugging Face's are the same."""
    return sorted({name.rsplit(".", 1)[-1] for name in module_names})


DEFAULT_TARGETS = resolve_targets(LoraConfig().targets)  # config's default: q_proj, v_proj


@dataclass(frozen=True)
class LoraSpec:
    """What the memory estimate and the FLOPs count need to know about LoRA/QLoRA."""
    rank: int = 8
    targets: tuple[str, ...] = DEFAULT_TARGETS
    quantize: Optional[str] = None  # None | "nf4" | "int8"
    dropout: float = 0.0
    base_dtype: Optional[str] = None  # storage of unquantized frozen weights; None: auto


def lora_spec(cfg: Any) -> Optional[LoraSpec]:
    """The ``lora`` section of a JobConfig as a LoraSpec; None when absent or disabled.
    ``lora.targets`` is resolved even when LoRA is off, so a bad name is refused either
    way. Read defensively: the section's fields are optional here."""
    section = getattr(cfg, "lora", None)
    if section is None:
        return None
    targets = resolve_targets(getattr(section, "targets", None) or list(DEFAULT_TARGETS))
    if not getattr(section, "enabled", True):
        return None
    rank = getattr(section, "rank", None) or getattr(section, "r", None) or 8
    quantize = getattr(section, "quantize", None)
    if isinstance(quantize, str) and quantize.lower() in ("", "none", "null", "bf16"):
        quantize = None
    if quantize is not None and str(quantize).lower() not in QUANTIZE_FORMATS:
        raise ConfigError(f"lora.quantize: {quantize!r} is not one of nf4, int8, none")
    spec = LoraSpec(rank=int(rank), targets=targets,
                    dropout=float(getattr(section, "dropout", 0.0) or 0.0),
                    base_dtype=getattr(section, "base_dtype", None))
    return spec if quantize is None else dataclasses.replace(spec, quantize=str(quantize).lower())
