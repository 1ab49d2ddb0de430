"""What a PEFT adapter directory says, checked before any of it is used.

``adapter_config.json``: every field lmforge computes with is checked for its type and
range (``r`` a positive integer, ``lora_alpha`` a positive finite number, ...); settings
that change what the weights mean and that lmforge does not implement (DoRA, biases,
``modules_to_save``, an initialisation that rewrites the base weights, ...) are refused
rather than ignored, and so is any setting lmforge does not know unless it is left off
(null, false, empty). ``adapter_model.safetensors``: every tensor must be the lora_A or
lora_B of a linear layer of the base model that takes adapters, named by
``target_modules``, with the shape ``r`` (or ``rank_pattern``) and the base layer give
it, in floating point and finite. ``target_parameters`` may name a mixture of experts'
stacked weights (``mlp.experts.gate_up_proj`` / ``down_proj``), nothing else; their
tensors are checked by ``peft.expert_adapters``.

Every path that loads an adapter (``lmforge lora merge``, ``eval-sft --adapter``,
``generate --adapter``, ``lora.adapter_from`` in training) reads it through
``peft.adapters.load_adapter``, which reads it through here.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Optional

import torch

from lmforge.models.mapping import first_nonfinite
from lmforge.models.registry import family_of, hf_names
from lmforge.peft.scaling import PEFT_PREFIX  # noqa: F401 (this module's readers import it)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])"
                       r"(?:\.(?P<adapter>[^.]+))?\.weight$")
# peft settings that change what the weights mean: refused unless at these values (off).
_REFUSED_OPTIONS = {
    "use_dora": False, "lora_bias": False, "fan_in_fan_out": False, "bias": "none",
    "modules_to_save": None, "layer_replication": None,
    "trainable_token_indices": None, "use_qalora": False, "alora_invocation_tokens": None,
    "arrow_config": None, "use_bdlora": None, "velora_config": None,
    "monteclora_config": None, "kasa_config": None}
# Read only by peft's bookkeeping, its training or its initialisation of new adapters
# (init_lora_weights is checked on its own): nothing a loaded adapter computes with.
_IGNORED = {"task_type", "auto_mapping", "peft_version", "base_model_name_or_path",
            "revision", "inference_mode", "megatron_core", "megatron_config",
            "loftq_config", "eva_config", "corda_config", "lora_ga_config",
            "qalora_group_size", "ensure_weight_tying", "runtime_config", "layers_pattern"}
_READ = {"peft_type", "r", "lora_alpha", "lora_dropout", "use_rslora", "target_modules",
         "exclude_modules", "rank_pattern", "alpha_pattern", "layers_to_transform",
         "init_lora_weights", "target_parameters"}
# init_lora_weights values that only say how peft drew fresh adapters; the others
# (pissa, olora, loftq, corda) make peft rewrite the base weights when it loads the
# adapter, which lmforge does not do: the adapter would be added to the wrong base.
_PLAIN_INITS = (True, False, "gaussian", "eva", "orthogonal")


class AdapterError(ValueError):
    """An adapter directory cannot be written or read; the message names the file or key."""


# ------------------------------------------------------------------ adapter_config.json

@dataclass(frozen=True)
class AdapterConfig:
    """adapter_config.json, checked: what loading the adapter computes with."""
    path: Path
    r: int
    lora_alpha: float
    lora_dropout: float
    use_rslora: bool
    target_modules: str | tuple[str, ...] | None  # None: only target_parameters
    exclude_modules: str | tuple[str, ...] | None
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    layers_to_transform: Optional[tuple[int, ...]]
    # peft's names of adapted nn.Parameters (the experts' stacks), matched as peft does:
    # a parameter's full HF name equal to one or ending with ``.`` + one
    target_parameters: Optional[tuple[str, ...]] = None

    def rank(self, module: str) -> int:
        return _pattern_value(self.rank_pattern, module, self.r)

    def alpha(self, module: str) -> float:
        return _pattern_value(self.alpha_pattern, module, self.lora_alpha)

    def targets(self, module: str, layer: int) -> bool:
        """peft's rule: whether this adapter puts LoRA on ``module`` (an HF module name
        of a linear layer that takes adapters, in block ``layer``)."""
        if self.exclude_modules is not None and _names(self.exclude_modules, module):
            return False
        if self.layers_to_transform is not None and layer not in self.layers_to_transform:
            return False
        if self.target_modules is None:
            return False
        return self.target_modules == "all-linear" or _names(self.target_modules, module)


def parse_adapter_config(raw: Any, path: Path) -> AdapterConfig:
    """The checked fields of ``raw`` (adapter_config.json's content, read from ``path``);
    refuses, naming the field, anything lmforge would misread or silently ignore."""
    if not isinstance(raw, dict):
        raise AdapterError(f"{path}: top level must be a JSON object")
    if raw.get("peft_type") != "LORA":
        raise AdapterError(f"{path}: peft_type = {raw.get('peft_type')!r}; only LORA "
                           f"adapters are supported")
    _refuse_unsupported(raw, path)
    field = _Fields(raw, path)
    target_parameters = field.parameter_names("target_parameters")
    return AdapterConfig(
        path=path, r=field.positive_int("r"),
        lora_alpha=field.positive_number("lora_alpha", default=8),
        lora_dropout=field.dropout(), use_rslora=field.boolean("use_rslora"),
        target_modules=field.module_names("target_modules",
                                          required=target_parameters is None),
        exclude_modules=field.module_names("exclude_modules"),
        rank_pattern=field.patterns("rank_pattern", _Fields.is_positive_int,
                                    "a positive integer"),
        alpha_pattern=field.patterns("alpha_pattern", _Fields.is_positive_number,
                                     "a positive finite number"),
        layers_to_transform=field.layers(), target_parameters=target_parameters)


def _refuse_unsupported(raw: dict, path: Path) -> None:
    for key, off in _REFUSED_OPTIONS.items():
        value = raw.get(key, off)
        if value != off and not (off is None and not value):
            raise AdapterError(f"{path}: {key} = {value!r} is not supported (lmforge "
                               f"needs {off!r})")
    init = raw.get("init_lora_weights", True)
    if not any(init is plain or (isinstance(plain, str) and init == plain)
               for plain in _PLAIN_INITS):
        raise AdapterError(f"{path}: init_lora_weights = {init!r} is not supported: peft "
                           f"rewrites the base weights for it when it loads the adapter, "
                           f"lmforge does not (convert it to a plain LoRA adapter first)")
    for key, value in raw.items():
        if key not in _READ | _IGNORED | set(_REFUSED_OPTIONS) and value not in (
                None, False, "", [], {}):
            raise AdapterError(f"{path}: {key} = {value!r} is a setting lmforge does not "
                               f"know; refusing the adapter rather than ignoring it")


class _Fields:
    """Typed reads of adapter_config.json's fields, each refused naming the field."""

    def __init__(self, raw: dict, path: Path):
        self.raw, self.path = raw, path

    def _bad(self, key: str, value: Any, what: str) -> AdapterError:
        return AdapterError(f"{self.path}: {key}: {value!r} is not {what}")

    @staticmethod
    def is_positive_int(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value > 0

    @staticmethod
    def is_positive_number(value: Any) -> bool:
        return (isinstance(value, (int, float)) and not isinstance(value, bool)
                and math.isfinite(value) and value > 0)

    def positive_int(self, key: str) -> int:
        value = self.raw.get(key)
        if not self.is_positive_int(value):
            raise self._bad(key, value, "a positive integer")
        return value

    def positive_number(self, key: str, default: float) -> float:
        value = self.raw.get(key, default)
        if not self.is_positive_number(value):
            raise self._bad(key, value, "a positive finite number")
        return float(value)

    def dropout(self) -> float:
        value = self.raw.get("lora_dropout") or 0.0
        if not (isinstance(value, (int, float)) and not isinstance(value, bool)
                and 0 <= value < 1):
            raise self._bad("lora_dropout", value, "a probability in [0, 1)")
        return float(value)

    def boolean(self, key: str) -> bool:
        value = self.raw.get(key, False)
        if not isinstance(value, bool):
            raise self._bad(key, value, "true or false")
        return value

    def module_names(self, key: str, required: bool = False):
        """A list of module names (peft: a name or a dotted suffix) or one regular
        expression (peft: matched against the whole module name)."""
        value = self.raw.get(key)
        if value in (None, []) and not required:  # (peft writes [] beside target_parameters)
            return None
        if isinstance(value, str) and value.strip():
            _compile(value, f"{self.path}: {key}")
            return value
        if (isinstance(value, list) and value
                and all(isinstance(v, str) and v.strip() for v in value)):
            return tuple(value)
        raise self._bad(key, value, "a non-empty list of module names or a regular "
                                    "expression")

    def parameter_names(self, key: str) -> Optional[tuple[str, ...]]:
        """peft's list of parameter names; None when absent or empty."""
        value = self.raw.get(key)
        if not value:
            return None
        if isinstance(value, list) and all(isinstance(v, str) and v.strip() for v in value):
            return tuple(value)
        raise self._bad(key, value, "a list of parameter names")

    def patterns(self, key: str, valid, what: str) -> dict:
        value = self.raw.get(key) or {}
        if not isinstance(value, dict):
            raise self._bad(key, value, "an object of module patterns")
        for pattern, setting in value.items():
            _compile(pattern, f"{self.path}: {key}")
            if not valid(setting):
                raise self._bad(f"{key}[{pattern!r}]", setting, what)
        return dict(value)

    def layers(self) -> Optional[tuple[int, ...]]:
        value = self.raw.get("layers_to_transform")
        if value is None or value == []:
            return None
        items = [value] if isinstance(value, int) and not isinstance(value, bool) else value
        if not (isinstance(items, list) and all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items)):
            raise self._bad("layers_to_transform", value, "a layer index or a list of them")
        return tuple(items)


def _compile(pattern: str, where: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except re.error as e:
        raise AdapterError(f"{where}: {pattern!r} is not a valid regular expression "
                           f"({e})") from None


def _names(names: str | tuple[str, ...], module: str) -> bool:
    """peft's matching: a string is a regular expression over the whole name; a list
    holds names, each matching itself or a module whose name ends with ``.name``."""
    if isinstance(names, str):
        return re.fullmatch(names, module) is not None
    return any(module == n or module.endswith(f".{n}") for n in names)


def _pattern_value(patterns: dict, module: str, default):
    """peft's rule: a pattern key matches a module whose name ends with it (regex)."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


# ------------------------------------------------------------------ the base model

class Linear(NamedTuple):
    """A linear layer of the base model that takes adapters."""
    ours: str  # our module name
    in_features: int
    out_features: int
    layer: int  # the block it is in


def adapter_linears(args) -> dict[str, Linear]:
    """HF module name -> every projection of every block of a model with ``args`` (the
    modules adapters may name; not the embedding or the head, as lora.targets)."""
    block = family_of(args).block(args)
    shapes = {**block.shapes, **block.linear_attention_shapes}  # (distinct leaf names)
    out = {}
    for ours, theirs in hf_names(args).items():
        module = ours.removesuffix(".weight")
        leaf = module.rsplit(".", 1)[-1]
        if ours.endswith(".weight") and ours.startswith("layers.") and leaf in shapes:
            in_features, out_features = shapes[leaf]
            out[theirs.removesuffix(".weight")] = Linear(
                module, in_features, out_features, int(module.split(".")[1]))
    return out


def check_against_base(config: AdapterConfig, linears: dict[str, Linear],
                       n_layers: int) -> None:
    """Every target_modules entry names a linear layer the base model has, and every
    layer in layers_to_transform exists."""
    if config.target_modules is None:
        pass
    elif isinstance(config.target_modules, tuple):
        leaves = sorted({name.rsplit(".", 1)[-1] for name in linears})
        for name in config.target_modules:
            if not any(_names((name,), module) for module in linears):
                raise AdapterError(f"{config.path}: target_modules: {name!r} matches no "
                                   f"linear layer of the base model that takes adapters "
                                   f"({', '.join(leaves)})")
    elif config.target_modules != "all-linear" and not any(
            _names(config.target_modules, module) for module in linears):
        raise AdapterError(f"{config.path}: target_modules: {config.target_modules!r} "
                           f"matches no linear layer of the base model")
    for layer in config.layers_to_transform or ():
        if layer >= n_layers:
            raise AdapterError(f"{config.path}: layers_to_transform: {layer} is not a "
                               f"layer of the base model (it has {n_layers})")


# ------------------------------------------------------------------ the tensors

def adapter_pairs(config: AdapterConfig, sd: dict[str, torch.Tensor],
                  linears: dict[str, Linear], source: Path, allow_empty: bool = False
                  ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """HF module name -> (lora_A, lora_B), every tensor of ``sd`` (read from ``source``)
    checked against ``config`` and the base model's ``linears``. The experts' tensors
    (``target_parameters``) are not read here: ``expert_adapters.checked_tensors`` takes
    them out first, and a caller that reads only linears refuses them."""
    pairs = _group_keys(sd, source)
    if not pairs and not allow_empty:
        raise AdapterError(f"{source}: holds no LoRA weights")
    for module, (a, b) in pairs.items():
        linear = linears.get(module)
        if linear is None and config.target_parameters:
            raise AdapterError(f"{source}: {module} is not a linear layer; an adapter of "
                               f"target_parameters {list(config.target_parameters)} is read "
                               f"by load_adapter only (merge it: lmforge lora merge)")
        if linear is None:
            raise AdapterError(f"{source}: {module} is not a linear layer of the base model "
                               f"that takes adapters (no such module, or the embedding or "
                               f"the head)")
        if not config.targets(module, linear.layer):
            raise AdapterError(f"{source}: holds weights for {module}, which "
                               f"{config.path.name} does not target ({_targeting(config)})")
        _check_shapes(config, module, a, b, linear, source)
    nonfinite = first_nonfinite(sd)
    if nonfinite is not None:
        raise AdapterError(f"{source}: tensor {nonfinite} holds NaN or Inf values")
    return pairs


def _check_shapes(config: AdapterConfig, module: str, a: torch.Tensor, b: torch.Tensor,
                  linear: Linear, source: Path) -> None:
    for ab, t in (("A", a), ("B", b)):
        if t.ndim != 2 or not t.is_floating_point():
            raise AdapterError(f"{source}: {module} lora_{ab} is a {t.ndim}-d {t.dtype} "
                               f"tensor; a floating-point matrix is needed")
    rank = config.rank(module)
    if a.shape[0] == b.shape[1] != rank:
        key = "rank_pattern" if rank != config.r else "r"
        raise AdapterError(f"{config.path}: {key}: {rank} does not match the rank "
                           f"{a.shape[0]} of {module}'s tensors in {source.name}")
    expected = ((rank, linear.in_features), (linear.out_features, rank))
    if (tuple(a.shape), tuple(b.shape)) != expected:
        raise AdapterError(f"{source}: {module} lora_A/lora_B shapes {tuple(a.shape)}/"
                           f"{tuple(b.shape)}, expected {expected[0]}/{expected[1]} (rank "
                           f"{rank}; the base layer is {linear.in_features} -> "
                           f"{linear.out_features})")


def _targeting(config: AdapterConfig) -> str:
    """The settings that choose the adapted modules, those that are set."""
    shown = lambda names: repr(names if isinstance(names, str) else list(names))  # noqa: E731
    parts = [f"target_modules: {shown(config.target_modules or [])}"]
    if config.exclude_modules is not None:
        parts.append(f"exclude_modules: {shown(config.exclude_modules)}")
    if config.layers_to_transform is not None:
        parts.append(f"layers_to_transform: {list(config.layers_to_transform)}")
    return "; ".join(parts)


def _group_keys(sd: dict, source: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    found: dict[str, dict[str, torch.Tensor]] = {}
    unexpected = []
    for key, tensor in sd.items():
        m = _PEFT_KEY.match(key)
        if m is None:
            unexpected.append(key)
            continue
        found.setdefault(m["module"], {})[m["ab"]] = tensor
    if unexpected:
        raise AdapterError(f"{source}: keys lmforge cannot load (only lora_A/lora_B of "
                           f"linear layers): {', '.join(unexpected[:4])}"
                           + (f", ... ({len(unexpected) - 4} more)" if len(unexpected) > 4
                              else ""))
    half = [k for k, v in found.items() if set(v) != {"A", "B"}]
    if half:
        raise AdapterError(f"{source}: {half[0]} has only one of lora_A / lora_B")
    return {k: (v["A"], v["B"]) for k, v in found.items()}
