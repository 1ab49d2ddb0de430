"""Adapters in peft's on-disk layout, and merged exports.

An adapter directory is what ``peft.PeftModel.save_pretrained`` writes and
``peft.PeftModel.from_pretrained(transformers_model, dir)`` reads:

- ``adapter_config.json``: ``peft_type: LORA``, ``r``, ``lora_alpha``, ``lora_dropout``,
  ``target_modules``, ``use_rslora``, ``base_model_name_or_path``, ...
- ``adapter_model.safetensors``: ``base_model.model.<HF module>.lora_A.weight`` (rank, in)
  and ``...lora_B.weight`` (out, rank), e.g.
  ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``.

Module names are translated with ``lmforge.models.hf.hf_names``, so adapters written here
load into transformers + peft and adapters peft wrote load here. ``export_merged`` writes
a plain Hugging Face model directory with the adapters added into the weights
(dequantizing a quantized base first), leaving the model it reads untouched.
"""
from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from lmforge import fsio
from lmforge.config import LoraConfig
from lmforge.models.hf import hf_names, save_hf_model
from lmforge.models.registry import build_model
from lmforge.parallel import full_value
from lmforge.peft.lora import LoraLinear, apply_lora, lora_layers
from lmforge.peft.quant import QuantizedLinear, is_quantized
from lmforge.peft.targets import target_modules

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
_PEFT_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])"
                       r"(?:\.(?P<adapter>[^.]+))?\.weight$")
# peft options that change what the weights mean; refused unless at these values.
_REFUSED_OPTIONS = {"use_dora": False, "lora_bias": False, "fan_in_fan_out": False,
                    "bias": "none", "modules_to_save": None, "layer_replication": None,
                    "target_parameters": None, "trainable_token_indices": None}


class AdapterError(ValueError):
    """An adapter directory cannot be written or read; the message names the file or key."""


# ------------------------------------------------------------------------ names

def _module_names(model: nn.Module) -> dict[str, str]:
    """Our module name -> HF module name for every linear an HF checkpoint holds."""
    args = getattr(model, "args", None)
    if args is None:
        raise AdapterError("adapters: the model has no .args (an lmforge model is needed "
                           "to translate module names)")
    return {ours.removesuffix(".weight"): theirs.removesuffix(".weight")
            for ours, theirs in hf_names(args).items()}


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The LoRA weights under peft's key names (CPU, contiguous, their own dtype)."""
    names = _module_names(model)
    layers = lora_layers(model)
    if not layers:
        raise AdapterError("save_adapter: the model has no LoRA layers")
    sd = {}
    for ours, layer in layers.items():
        if layer.merged:
            raise AdapterError(f"save_adapter: {ours} is merged; unmerge_lora(model) first")
        theirs = PEFT_PREFIX + names[ours]
        sd[f"{theirs}.lora_A.weight"] = full_value(layer.lora_a).cpu().contiguous()
        sd[f"{theirs}.lora_B.weight"] = full_value(layer.lora_b).cpu().contiguous()
    return sd


# ------------------------------------------------------------------------- save

def save_adapter(model: nn.Module, out_dir: str | Path, base_model_path: Optional[str] = None,
                 lora_cfg=None) -> Path:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` to ``out_dir``
    (atomically: a temporary sibling renamed into place).

    ``base_model_path``: the HF directory (or hub id) the adapter belongs to, recorded as
    ``base_model_name_or_path``. ``lora_cfg`` (a ``LoraConfig``) supplies the dropout;
    rank, alpha, rsLoRA and the target modules are read off the LoRA layers themselves, so
    the file always describes the weights."""
    from safetensors.torch import save_file

    sd = adapter_state_dict(model)
    names = _module_names(model)
    layers = {names[ours]: layer for ours, layer in lora_layers(model).items()}
    config = _peft_config(layers, base_model_path, lora_cfg)
    out = Path(out_dir)
    if out.exists() and not (out.is_dir() and ((out / ADAPTER_CONFIG).is_file()
                                               or not any(out.iterdir()))):
        raise AdapterError(f"{out}: exists and is not an adapter directory; refusing to "
                           f"replace it")
    with fsio.atomic_dir(out) as tmp:
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        save_file(sd, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    return out


def _peft_config(layers: dict[str, LoraLinear], base_model_path, lora_cfg) -> dict:
    """``layers``: HF module name -> LoRA layer."""
    ranks = Counter(layer.rank for layer in layers.values())
    alphas = Counter(layer.alpha for layer in layers.values())
    rslora = {layer.rslora for layer in layers.values()}
    if len(rslora) > 1:
        raise AdapterError("save_adapter: layers mix rsLoRA and plain scaling")
    r, alpha = ranks.most_common(1)[0][0], alphas.most_common(1)[0][0]
    # Layers off the common rank/alpha are written as peft patterns (full module names).
    rank_pattern = {name: x.rank for name, x in layers.items() if x.rank != r}
    alpha_pattern = {name: x.alpha for name, x in layers.items() if x.alpha != alpha}
    first = next(iter(layers.values()))
    dropout = float(getattr(lora_cfg, "dropout", first.dropout))
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM",
        "base_model_name_or_path": None if base_model_path is None else str(base_model_path),
        "r": r, "lora_alpha": alpha, "lora_dropout": dropout, "use_rslora": rslora.pop(),
        "target_modules": target_modules(layers),
        "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern,
        "bias": "none", "fan_in_fan_out": False, "init_lora_weights": True,
        "inference_mode": True, "modules_to_save": None, "layers_to_transform": None,
        "use_dora": False, "revision": None,
    }


# ------------------------------------------------------------------------- load

def read_adapter(adapter_dir: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """adapter_config.json and the adapter weights, checked for what we support."""
    from safetensors.torch import load_file

    root = Path(adapter_dir)
    cfg_path = root / ADAPTER_CONFIG
    if not cfg_path.is_file():
        raise AdapterError(f"{cfg_path}: not found (a PEFT adapter directory needs it)")
    try:
        config = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdapterError(f"{cfg_path}: not valid JSON ({e})") from None
    if config.get("peft_type") != "LORA":
        raise AdapterError(f"{cfg_path}: peft_type = {config.get('peft_type')!r}; only LORA "
                           f"adapters are supported")
    for key, allowed in _REFUSED_OPTIONS.items():
        value = config.get(key, allowed)
        if value != allowed and not (allowed is None and not value):
            raise AdapterError(f"{cfg_path}: {key} = {value!r} is not supported "
                               f"(lmforge needs {allowed!r})")
    weights = root / ADAPTER_WEIGHTS
    if not weights.is_file():
        extra = " (adapter_model.bin found: lmforge reads safetensors only)" if (
            root / "adapter_model.bin").is_file() else ""
        raise AdapterError(f"{weights}: not found{extra}")
    try:
        return config, load_file(str(weights))
    except Exception as e:  # safetensors raises its own error type on a bad header
        raise AdapterError(f"{weights}: not a readable safetensors file ({e})") from None


def load_adapter(model: nn.Module, adapter_dir: str | Path, strict: bool = True):
    """Load a peft LoRA adapter into ``model``: target linears without LoRA are swapped
    first (rank from the tensors, alpha / rsLoRA / dropout from the config), existing LoRA
    layers must have the same rank. ``strict``: every key must find a module (set False on
    a pipeline stage that holds only some layers). Returns a ``lmforge.config.LoraConfig``
    describing the adapter."""
    root = Path(adapter_dir)
    config, sd = read_adapter(root)
    by_hf = {theirs: ours for ours, theirs in _module_names(model).items()}
    pairs = _group_keys(sd, root / ADAPTER_WEIGHTS)
    modules = dict(model.named_modules())
    rslora = bool(config.get("use_rslora", False))
    dropout = float(config.get("lora_dropout") or 0.0)
    loaded, ranks = 0, Counter()
    for hf_module, (a, b) in pairs.items():
        ours = by_hf.get(hf_module)
        if ours is None or ours not in modules:
            if strict:
                raise AdapterError(f"{root / ADAPTER_WEIGHTS}: {hf_module} has no matching "
                                   f"module in the model")
            continue
        rank = a.shape[0]
        alpha = float(_pattern_value(config.get("alpha_pattern") or {}, hf_module,
                                     config.get("lora_alpha", 8)))
        layer = modules[ours]
        if not isinstance(layer, LoraLinear):
            settings = LoraConfig(enabled=True, rank=rank, alpha=alpha, dropout=dropout,
                                  rslora=rslora)
            apply_lora(model, settings, module_names=[ours])
            layer = model.get_submodule(ours)
        elif layer.rank != rank:
            raise AdapterError(f"{root / ADAPTER_WEIGHTS}: {hf_module} has rank {rank} but "
                               f"the model's LoRA layer {ours} has rank {layer.rank}")
        if layer.merged:
            raise AdapterError(f"load_adapter: {ours} is merged; unmerge_lora(model) first")
        expected = ((rank, layer.in_features), (layer.out_features, rank))
        if (tuple(a.shape), tuple(b.shape)) != expected:
            raise AdapterError(f"{root / ADAPTER_WEIGHTS}: {hf_module} lora_A/lora_B shapes "
                               f"{tuple(a.shape)}/{tuple(b.shape)}, expected "
                               f"{expected[0]}/{expected[1]}")
        layer.alpha, layer.rslora, layer.dropout = alpha, rslora, dropout
        _copy_into(layer.lora_a, a)
        _copy_into(layer.lora_b, b)
        loaded += 1
        ranks[rank] += 1
    if loaded == 0:
        raise AdapterError(f"{root / ADAPTER_WEIGHTS}: no LoRA weights matched the model")
    targets = target_modules(pairs)
    return LoraConfig(enabled=True, rank=ranks.most_common(1)[0][0],
                      alpha=float(config.get("lora_alpha", 8)), dropout=dropout,
                      targets=targets, rslora=rslora, adapter_from=str(root))


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


def _pattern_value(patterns: dict, module: str, default):
    """peft's rule: a pattern key matches a module whose name ends with it (regex)."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


@torch.no_grad()
def _copy_into(param: torch.Tensor, value: torch.Tensor) -> None:
    value = value.to(device=_local_device(param), dtype=param.dtype)
    placements = getattr(param, "placements", None)
    if placements is not None:
        from torch.distributed.tensor import distribute_tensor

        value = distribute_tensor(value, param.device_mesh, placements)
    param.copy_(value)


def _local_device(t: torch.Tensor) -> torch.device:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.device




# ------------------------------------------------------------------- merged export

@torch.no_grad()
def merged_state_dict(model: nn.Module, dtype: Optional[torch.dtype] = None
                      ) -> dict[str, torch.Tensor]:
    """A plain Llama state dict (our names, CPU) with every adapter added into its weight
    and every quantized weight dequantized. The merge is computed in fp32 and cast to
    ``dtype`` (None: each tensor keeps its dtype, except that a model with a quantized base
    is exported all in bf16). The model
    itself is not changed."""
    if dtype is None and is_quantized(model):
        dtype = torch.bfloat16  # one dtype for the whole export, not bf16 beside fp32
    out: dict[str, torch.Tensor] = {}
    replaced: set[str] = set()
    for name, module in model.named_modules():
        if isinstance(module, LoraLinear):
            w = full_value(module.base_weight(torch.float32))
            if not module.merged:
                w = w + full_value(module.delta_weight(torch.float32))
            out[f"{name}.weight"] = w.to("cpu", dtype or module.weight.dtype)
            replaced.add(name)
            if module.bias is not None:
                out[f"{name}.bias"] = full_value(module.bias).to("cpu", dtype or module.bias.dtype)
        elif isinstance(module, QuantizedLinear) and not name.endswith(".quantized"):
            out[f"{name}.weight"] = module.dequantize(dtype).cpu()
            replaced.add(name)
            if module.bias is not None:
                out[f"{name}.bias"] = full_value(module.bias).to("cpu", dtype or module.bias.dtype)
    for key, value in model.state_dict().items():
        module_name = key.rsplit(".", 1)[0]
        if module_name in replaced or module_name.endswith(".quantized") or (
                key.rsplit(".", 1)[-1] in ("lora_a", "lora_b")):
            continue
        value = full_value(value)
        if dtype is not None and value.is_floating_point():
            value = value.to(dtype)
        out[key] = value.cpu()
    return out


def export_merged(model: nn.Module, out_dir: str | Path, tokenizer=None,
                  dtype: Optional[torch.dtype] = None, **save_kwargs) -> Path:
    """Write a Hugging Face model directory of ``model`` with its adapters merged (a
    quantized base is dequantized to ``dtype`` first, bf16 by default). Uses
    ``lmforge.models.hf.save_hf_model``; the model passed in is left as it was."""
    sd = merged_state_dict(model, dtype)
    plain = build_model(model.args)
    plain.load_state_dict(sd, strict=True, assign=True)
    if model.args.tie_embeddings:
        plain.output.weight = plain.tok_embeddings.weight
    return save_hf_model(plain, out_dir, tokenizer=tokenizer, **save_kwargs)
