"""Adapters on the layers a family's checkpoint files fuse where lmforge keeps the parts
apart (``Projections.fused_in_files``: Qwen3-Next's in_proj_qkvz holds our in_proj_qkv and
in_proj_z, in_proj_ba our in_proj_b and in_proj_a). transformers' model, and so peft,
holds the fused layer: ``fuse_parts`` writes the parts' adapters as one adapter on it,
``split_fused`` reads such an adapter back as adapters on the parts (``peft.adapters``
calls both)."""
from __future__ import annotations

import dataclasses
import itertools
import math
import re
from pathlib import Path
from typing import Mapping, NamedTuple

import torch
from torch import nn

from lmforge.models.registry import family_of
from lmforge.peft.adapter_spec import PEFT_PREFIX, AdapterConfig, AdapterError, adapter_linears
from lmforge.peft.lora import lora_layers
from lmforge.peft.scaling import lora_scaling


class Scaled(NamedTuple):
    """One adapter's rank and alpha, as adapter_config.json records them."""
    rank: int
    alpha: float
    rslora: bool

    @property
    def scaling(self) -> float:
        return lora_scaling(self.alpha, self.rank, self.rslora)

    def alpha_at(self, rank: int) -> float:
        """The alpha that keeps this scaling at ``rank``."""
        ratio = rank / self.rank
        return self.alpha * (math.sqrt(ratio) if self.rslora else ratio)



# ----------------------------------------------------------- layers the files fuse

def _fused_linears(args, linears: Mapping) -> dict[str, tuple[str, ...]]:
    """HF module -> its parts' HF modules, for every layer the family's files fuse
    (``Projections.fused_in_files``); ``linears``: ``adapter_linears(args)``."""
    out = {}
    for name, parts in family_of(args).projections.fused_in_files.items():
        for module in linears:
            prefix, _, leaf = module.rpartition(".")
            if leaf == parts[0]:
                out[f"{prefix}.{name}"] = tuple(f"{prefix}.{part}" for part in parts)
    return out


def _file_rows(args, parts: tuple[str, ...], linears: Mapping) -> torch.Tensor:
    """Row i of the fused layer is row ``index[i]`` of its parts' rows one after another:
    the family's ``checkpoint_out``, which fuses the weights, run over the rows' numbers."""
    numbered, start = {}, 0
    for part in parts:
        rows = linears[part].out_features
        numbered[f"{part}.weight"] = torch.arange(start, start + rows)[:, None]
        start += rows
    (fused,) = family_of(args).checkpoint_out(numbered, args).values()
    return fused[:, 0]


def fuse_parts(pairs: dict, scales: dict[str, Scaled], args) -> None:
    """In ``pairs`` (HF module -> (A, B)) and ``scales``, the adapters on the parts of each
    layer the files fuse (Qwen3-Next's in_proj_qkv and in_proj_z) become one on that layer
    (in_proj_qkvz) computing the same update: A the parts' A stacked (its rank the sum of
    theirs), B block-diagonal with its rows in the fused layer's order, each part's block
    scaled to the first part's scaling, which the fused alpha keeps (peft's rank_pattern
    and alpha_pattern record both); a part without an adapter adds zero rows."""
    linears = adapter_linears(args)
    for fused, parts in _fused_linears(args, linears).items():
        present = [part for part in parts if part in pairs]
        if not present:
            continue
        first = scales[present[0]]
        rank = sum(scales[part].rank for part in present)
        lora_b = pairs[present[0]][1]
        blocks, column = [], 0
        for part in parts:
            block = lora_b.new_zeros(linears[part].out_features, rank)
            if part in pairs:
                width = scales[part].rank
                ratio = scales[part].scaling / first.scaling  # 1.0 (exact) as a rule
                block[:, column:column + width] = pairs[part][1] * ratio
                column += width
            blocks.append(block)
        pairs[fused] = (torch.cat([pairs[part][0] for part in present]),
                        torch.cat(blocks)[_file_rows(args, parts, linears)])
        scales[fused] = Scaled(rank, first.alpha_at(rank), first.rslora)
        for part in present:
            del pairs[part], scales[part]


def split_fused(config: AdapterConfig, sd: dict, model: nn.Module, source: Path
                 ) -> tuple[AdapterConfig, dict]:
    """An adapter on a layer the files fuse (peft's on transformers' Qwen3-Next:
    in_proj_qkvz) as adapters on its parts, each with its rows of B, and ``config`` saying
    so. Where the model holds LoRA layers on the parts already (training resumed from an
    adapter ``save_adapter`` wrote), each part takes its own block of the rank, as
    ``fuse_parts`` stacked them, and its rows of B must be zero outside it (else the
    adapter is refused); otherwise each part takes the whole A: the same update, at the
    fused rank."""
    args = model.args
    linears = adapter_linears(args)
    fused = {name: parts for name, parts in _fused_linears(args, linears).items()
             if any(f"{PEFT_PREFIX}{name}.lora_{ab}.weight" in sd for ab in "AB")}
    if not fused:
        return config, sd
    sd, split = dict(sd), {}
    ranks = {name: layer.rank for name, layer in lora_layers(model).items()}
    for name, parts in fused.items():
        a, b = _fused_pair(config, sd, name, parts, linears, source)
        scaled = Scaled(a.shape[0], config.alpha(name), config.use_rslora)
        held = [ranks.get(linears[part].ours, 0) for part in parts]
        if any(held) and sum(held) != scaled.rank:
            raise AdapterError(f"{source}: {name} has rank {scaled.rank}, which does not "
                               f"split into the model's LoRA layers on its parts (ranks "
                               f"{held})")
        rows = b[torch.argsort(_file_rows(args, parts, linears))]
        for part, lora_b, columns in zip(
                parts, rows.split([linears[part].out_features for part in parts]),
                _blocks(held, scaled.rank)):
            outside = lora_b.clone()
            outside[:, columns] = 0
            if outside.any():
                raise AdapterError(f"{source}: {name} does not split exactly into the "
                                   f"model's LoRA layers on its parts (ranks {held}): "
                                   f"{part}'s rows of lora_B reach other columns")
            width = columns.stop - columns.start
            if width:
                sd[f"{PEFT_PREFIX}{part}.lora_A.weight"] = a[columns]
                sd[f"{PEFT_PREFIX}{part}.lora_B.weight"] = lora_b[:, columns]
                split[part] = (width, scaled.alpha_at(width))
    return _config_for_parts(config, split, family_of(args).projections.fused_in_files), sd


def _blocks(held: list[int], rank: int) -> list[slice]:
    """Each part's columns of the fused adapter's ``rank``: its own block where the model
    holds LoRA layers on the parts (ranks ``held``, 0 for none), else all of them."""
    if not any(held):
        return [slice(0, rank)] * len(held)
    ends = list(itertools.accumulate(held))
    return [slice(end - width, end) for end, width in zip(ends, held)]


def _fused_pair(config: AdapterConfig, sd: dict, name: str, parts: tuple[str, ...],
                linears: Mapping, source: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused layer's (lora_A, lora_B), taken out of ``sd``, checked against
    ``config`` and the layer's shape."""
    a = sd.pop(f"{PEFT_PREFIX}{name}.lora_A.weight", None)
    b = sd.pop(f"{PEFT_PREFIX}{name}.lora_B.weight", None)
    if a is None or b is None:
        raise AdapterError(f"{source}: {name} has only one of lora_A / lora_B")
    if not config.targets(name, linears[parts[0]].layer):
        raise AdapterError(f"{source}: holds weights for {name}, which {config.path.name} "
                           f"does not target")
    rank = config.rank(name)
    expected = ((rank, linears[parts[0]].in_features),
                (sum(linears[part].out_features for part in parts), rank))
    if (tuple(a.shape), tuple(b.shape)) != expected:
        raise AdapterError(f"{source}: {name} lora_A/lora_B shapes {tuple(a.shape)}/"
                           f"{tuple(b.shape)}, expected {expected[0]}/{expected[1]} (rank "
                           f"{rank})")
    return a, b


def _config_for_parts(config: AdapterConfig, split: dict[str, tuple[int, float]],
                      fused: Mapping[str, tuple[str, ...]]) -> AdapterConfig:
    """``config`` naming the parts where it names a fused layer (target_modules,
    exclude_modules), with each part's rank and alpha (``split``: HF module -> both)."""
    exact = {re.escape(part): part for part in split}
    return dataclasses.replace(
        config, target_modules=_part_names(config.target_modules, fused),
        exclude_modules=_part_names(config.exclude_modules, fused),
        rank_pattern={**{k: split[p][0] for k, p in exact.items()}, **config.rank_pattern},
        alpha_pattern={**{k: split[p][1] for k, p in exact.items()}, **config.alpha_pattern})


def _part_names(names, fused: Mapping[str, tuple[str, ...]]):
    """peft's module names (a list, or one regular expression) with each fused layer's
    name standing for its parts' (``in_proj_qkvz``: ``in_proj_qkv``, ``in_proj_z``)."""
    if isinstance(names, str):
        for name, parts in fused.items():
            names = names.replace(name, f"(?:{'|'.join(parts)})")
        return names
    if names is None:
        return None
    out = []
    for entry in names:
        prefix, dot, leaf = entry.rpartition(".")
        out += [prefix + dot + part for part in fused[leaf]] if leaf in fused else [entry]
    return tuple(dict.fromkeys(out))
