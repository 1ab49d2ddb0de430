"""Model families, found and chosen by Hugging Face's ``model_type`` (config.json) or by
a preset.

A family is a folder, ``models/<family>/``, whose ``__init__.py`` exports ``FAMILY``
(``models/family.py`` says what it holds). The folders are found here, so adding a
family edits no list; nothing outside ``models/`` branches on a family's name: the
trainer, parallelism, LoRA, export and the performance model ask the family of the
model's ``args`` (``family_of``) and read its ``BlockSpec``.
"""
from __future__ import annotations

import importlib
import pkgutil
from typing import Any

import torch
from torch import nn

import lmforge.models
from lmforge.models.common import Projections
from lmforge.models.family import BlockSpec, Fused, ModelFamily
from lmforge.models.mapping import HFCheckpointError

__all__ = ["BlockSpec", "FAMILIES", "Fused", "ModelFamily", "PRESETS", "Projections",
           "args_from_dict", "args_from_hf_config", "build_model", "family_for_config",
           "family_of", "hf_config_from_args", "hf_names"]


def _find_families() -> tuple[ModelFamily, ...]:
    """Every subpackage of ``lmforge.models`` that exports ``FAMILY``, by folder name."""
    found = []
    for info in sorted(pkgutil.iter_modules(lmforge.models.__path__), key=lambda m: m.name):
        if info.ispkg:
            family = getattr(importlib.import_module(f"lmforge.models.{info.name}"),
                             "FAMILY", None)
            if family is not None:
                found.append(family)
    return tuple(found)


FAMILIES: tuple[ModelFamily, ...] = _find_families()
_BY_MODEL_TYPE = {t: f for f in FAMILIES for t in f.model_types}
PRESETS: dict[str, Any] = {name: args for f in FAMILIES for name, args in f.presets.items()}


def family_of(args: Any) -> ModelFamily:
    """The family of a model's args (``args.family`` is its HF model_type)."""
    return _BY_MODEL_TYPE[args.family]


def family_for_config(cfg: dict, source: str = "config.json") -> ModelFamily:
    """The family that loads an HF config.json, or a one-line refusal naming the field."""
    model_type = cfg.get("model_type")
    if model_type not in _BY_MODEL_TYPE:
        raise HFCheckpointError(f"{source}: model_type = {model_type!r} is not supported "
                                f"(lmforge loads {', '.join(sorted(_BY_MODEL_TYPE))})")
    return _BY_MODEL_TYPE[model_type]


def args_from_dict(recorded: dict) -> Any:
    """Args from their ``dataclasses.asdict`` record (checkpoints' meta.json); records
    written before families existed are Llama's."""
    return _BY_MODEL_TYPE[recorded.get("family", "llama")].args_from_dict(recorded)


def build_model(args: Any, device: str | torch.device = "meta") -> nn.Module:
    """Construct on ``device`` (meta by default: no memory is touched, so a 70B preset is
    free to build). Allocate with ``models.common.materialize``."""
    with torch.device(device):
        return family_of(args).build(args)


def args_from_hf_config(cfg: dict, source: str = "config.json") -> Any:
    return family_for_config(cfg, source).args_from_hf_config(cfg, source)


def hf_config_from_args(args: Any, **extra) -> dict:
    """config.json for ``args``; ``extra`` adds or overrides fields (``torch_dtype``,
    ``bos_token_id``, ...). Special-token ids are always written, null where the
    tokenizer has none: left out, transformers would take its config class's default
    (Phi-3's 32000), which may lie outside a small vocabulary."""
    ids = dict.fromkeys(("bos_token_id", "eos_token_id", "pad_token_id"))
    return ids | family_of(args).hf_config(args) | extra


def hf_names(args: Any) -> dict[str, str]:
    """Our parameter name -> HF name for every tensor an HF checkpoint holds."""
    return family_of(args).hf_names(args)
