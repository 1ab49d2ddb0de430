"""Adapters in peft's on-disk layout, and merged exports.

An adapter directory is what ``peft.PeftModel.save_pretrained`` writes and
``peft.PeftModel.from_pretrained(transformers_model, dir)`` reads:

- ``adapter_config.json``: ``peft_type: LORA``, ``r``, ``lora_alpha``, ``lora_dropout``,
  ``target_modules``, ``use_rslora``, ``base_model_name_or_path``, ...
- ``adapter_model.safetensors``: ``base_model.model.<HF module>.lora_A.weight`` (rank, in)
  and ``...lora_B.weight`` (out, rank), e.g.
  ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``.

Module names are translated with ``lmforge.models.hf.hf_names``, so adapters written here
load into transformers + peft and adapters peft wrote load here. A layer the checkpoint
files fuse where we keep its parts apart (``Projections.fused_in_files``: Qwen3-Next's
in_proj_qkvz holds our in_proj_qkv and in_proj_z) is what transformers' model, and so
peft, holds: the parts' adapters are written as one adapter on it (``fuse_parts``) and
read back apart (``split_fused``), both in ``peft/fused_adapters.py``. What is read is checked first, whole, by
``adapter_spec`` (every field, every tensor, against the base model).
``export_merged`` writes a plain Hugging Face model directory with the adapters added into
the weights (dequantizing a quantized base first), leaving the model it reads untouched.
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from lmforge import fsio
from lmforge.config import LoraConfig
from lmforge.models.hf import fused_rows, hf_names, save_hf_model
from lmforge.models.registry import build_model, family_of
from lmforge.parallel import full_value
from lmforge.peft import expert_lora
from lmforge.peft.adapter_spec import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_PREFIX,
                                       AdapterConfig, AdapterError, adapter_linears,
                                       parse_adapter_config)
from lmforge.peft.expert_adapters import checked_tensors, load_experts, present_experts
from lmforge.peft.fused_adapters import Scaled, fuse_parts, split_fused
from lmforge.peft.lora import (LoraLinear, apply_lora, expert_layers, is_lora_param,
                               lora_layers)
from lmforge.peft.scaling import copy_into
from lmforge.peft.quant import QuantizedLinear, is_quantized
from lmforge.peft.quant_experts import STACKS, QuantizableExperts
from lmforge.peft.targets import target_modules

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
    """The LoRA weights under peft's key names (CPU, contiguous, their own dtype); the
    experts' as peft's ``target_parameters`` adapters store them (``expert_lora``), the
    parts of a layer the files fuse as one adapter on it (``fuse_parts``)."""
    return _adapter(model)[0]


def _adapter(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, Scaled]]:
    """(``adapter_state_dict``, HF module -> its adapter's rank and alpha)."""
    names = _module_names(model)
    layers = lora_layers(model)
    if not layers and not expert_layers(model):
        raise AdapterError("save_adapter: the model has no LoRA layers")
    pairs, scales = {}, {}
    for ours, layer in layers.items():
        if layer.merged:
            raise AdapterError(f"save_adapter: {ours} is merged; unmerge_lora(model) first")
        lora_b = full_value(layer.lora_b).cpu()
        rows = fused_rows(model.args, ours, to_hf=True)  # a fused projection's: HF's order
        pairs[names[ours]] = (full_value(layer.lora_a).cpu(),
                              lora_b if rows is None else lora_b[rows])
        scales[names[ours]] = Scaled(layer.rank, layer.alpha, layer.rslora)
    fuse_parts(pairs, scales, model.args)
    sd = _expert_state_dict(model, names)
    for module, (a, b) in pairs.items():
        sd[f"{PEFT_PREFIX}{module}.lora_A.weight"] = a.contiguous()
        sd[f"{PEFT_PREFIX}{module}.lora_B.weight"] = b.contiguous()
    return sd, scales


def _expert_state_dict(model: nn.Module, names: dict[str, str]) -> dict[str, torch.Tensor]:
    sd = {}
    layout = family_of(model.args).expert_layout
    for ours, experts in expert_layers(model).items():
        block = {f"experts.{k}": full_value(v).cpu() for k, v in experts.state_dict().items()
                 if is_lora_param(k)}
        sd |= expert_lora.to_peft(block, _expert_prefix(names, ours), layout)
    return sd


def _expert_prefix(names: dict[str, str], experts: str) -> str:
    """The HF module holding the experts module ``experts`` (ours), with a trailing dot:
    ``layers.3.feed_forward.experts`` -> ``model.layers.3.mlp.``."""
    return names[f"{experts}.down_proj"].removesuffix("experts.down_proj")


def _target_parameters(model: nn.Module, names: dict[str, str]) -> Optional[list[str]]:
    """peft's ``target_parameters``: each adapted stacked weight's HF name inside its
    layer (``mlp.experts.gate_up_proj``), as peft matches them; None without any."""
    found = []
    for ours, experts in expert_layers(model).items():
        for target in experts.lora:
            inside = names[f"{ours}.{target}"].split(".", 3)[-1]  # past model.layers.{i}.
            if inside not in found:
                found.append(inside)
    return found or None


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

    sd, layers = _adapter(model)
    names = _module_names(model)
    experts = {names[f"{ours}.{target}"]: adapter
               for ours, module in expert_layers(model).items()
               for target, adapter in module.lora.items()}
    first = next(iter(lora_layers(model).values()), None)
    dropout = float(getattr(lora_cfg, "dropout", first.dropout if first else 0.0))
    config = _peft_config(layers, base_model_path, dropout, experts)
    config["target_parameters"] = _target_parameters(model, names)
    out = Path(out_dir)
    if out.exists() and not (out.is_dir() and ((out / ADAPTER_CONFIG).is_file()
                                               or not any(out.iterdir()))):
        raise AdapterError(f"{out}: exists and is not an adapter directory; refusing to "
                           f"replace it")
    with fsio.atomic_dir(out) as tmp:
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        save_file(sd, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    return out


def _peft_config(layers: dict[str, Scaled], base_model_path, dropout: float,
                 experts: dict) -> dict:
    """``layers``: HF module name -> its adapter's rank and alpha; ``experts``: HF
    parameter name (peft's key for a target parameter,
    ``model.layers.0.mlp.experts.down_proj``) -> its ``ExpertLora``. A rank or alpha off
    the common one is written as a peft pattern (full names)."""
    adapters = {**layers, **experts}
    ranks = Counter(x.rank for x in adapters.values())
    alphas = Counter(x.alpha for x in adapters.values())
    rslora = {x.rslora for x in adapters.values()}
    if len(rslora) > 1:
        raise AdapterError("save_adapter: layers mix rsLoRA and plain scaling")
    r, alpha = ranks.most_common(1)[0][0], alphas.most_common(1)[0][0]
    rank_pattern = {name: x.rank for name, x in adapters.items() if x.rank != r}
    alpha_pattern = {name: x.alpha for name, x in adapters.items() if x.alpha != alpha}
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
    """adapter_config.json (checked: ``adapter_spec.parse_adapter_config``) and the
    adapter weights, as read."""
    raw, _, sd = _read(Path(adapter_dir))
    return raw, sd


def read_adapter_config(adapter_dir: str | Path) -> tuple[AdapterConfig,
                                                           dict[str, torch.Tensor]]:
    """adapter_config.json as checked (ranks and alphas per module) and the weights."""
    _, config, sd = _read(Path(adapter_dir))
    return config, sd


def _read(root: Path) -> tuple[dict, AdapterConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    cfg_path = root / ADAPTER_CONFIG
    if not cfg_path.is_file():
        raise AdapterError(f"{cfg_path}: not found (a PEFT adapter directory needs it)")
    try:
        raw = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdapterError(f"{cfg_path}: not valid JSON ({e})") from None
    config = parse_adapter_config(raw, cfg_path)
    weights = root / ADAPTER_WEIGHTS
    if not weights.is_file():
        extra = " (adapter_model.bin found: lmforge reads safetensors only)" if (
            root / "adapter_model.bin").is_file() else ""
        raise AdapterError(f"{weights}: not found{extra}")
    try:
        return raw, config, load_file(str(weights))
    except Exception as e:  # safetensors raises its own error type on a bad header
        raise AdapterError(f"{weights}: not a readable safetensors file ({e})") from None


def load_adapter(model: nn.Module, adapter_dir: str | Path, strict: bool = True):
    """Load a peft LoRA adapter into ``model``: target linears without LoRA are swapped
    first (rank, alpha, rsLoRA and dropout from the config), existing LoRA layers must have
    the same rank; the MoE experts' adapters (``target_parameters``) likewise
    (``expert_adapters``). The whole adapter is checked against the model's architecture
    (``adapter_spec``) before the model is touched. ``strict``: every tensor must find its
    module in ``model`` (set False on a pipeline stage that holds only some layers).
    Returns a ``lmforge.config.LoraConfig`` describing the adapter."""
    root = Path(adapter_dir)
    _, config, sd = _read(root)
    args = getattr(model, "args", None)
    if args is None:
        raise AdapterError("load_adapter: the model has no .args (an lmforge model is "
                           "needed to translate module names)")
    config, sd = split_fused(config, sd, model, root / ADAPTER_WEIGHTS)
    pairs, experts = checked_tensors(config, sd, args, root / ADAPTER_WEIGHTS)
    linears = adapter_linears(args)
    present = _present_linears(model, pairs, linears, config, strict, root)
    moe_present = present_experts(model, experts, strict, root / ADAPTER_WEIGHTS)
    if not present and not moe_present:
        raise AdapterError(f"{root / ADAPTER_WEIGHTS}: no LoRA weights matched the model")
    for hf_module, (a, b) in present.items():
        _load_pair(model, linears[hf_module].ours, config, hf_module, a, b)
    load_experts(model, moe_present, config)
    ranks = Counter([config.rank(m) for m in present]
                    + [r for e in moe_present for r in e.ranks])
    expert_targets = [f"experts.{t}" for t in expert_lora.EXPERT_TARGETS
                      if any(t in e.targets for e in experts)]
    return LoraConfig(enabled=True, rank=ranks.most_common(1)[0][0],
                      alpha=config.lora_alpha, dropout=config.lora_dropout,
                      targets=target_modules(pairs) + expert_targets,
                      rslora=config.use_rslora, adapter_from=str(root))


def _present_linears(model: nn.Module, pairs: dict, linears: dict, config: AdapterConfig,
                     strict: bool, root: Path) -> dict:
    """The pairs whose linear ``model`` holds (all, when ``strict``), each checked to fit
    the LoRA layer the model has already."""
    modules = dict(model.named_modules())
    present = {m: ab for m, ab in pairs.items() if linears[m].ours in modules}
    if strict and len(present) < len(pairs):
        missing = next(m for m in pairs if m not in present)
        raise AdapterError(f"{root / ADAPTER_WEIGHTS}: {missing} has no matching module "
                           f"in the model")
    for hf_module in present:
        _check_layer(modules[linears[hf_module].ours], config, hf_module, root)
    return present


def _check_layer(layer: nn.Module, config: AdapterConfig, hf_module: str,
                 root: Path) -> None:
    """A LoRA layer the model has already must take the adapter as it is."""
    if not isinstance(layer, LoraLinear):
        return
    if layer.rank != config.rank(hf_module):
        raise AdapterError(f"{root / ADAPTER_WEIGHTS}: {hf_module} has rank "
                           f"{config.rank(hf_module)} but the model's LoRA layer has rank "
                           f"{layer.rank}")
    if layer.merged:
        raise AdapterError(f"load_adapter: {hf_module} is merged in the model; "
                           f"unmerge_lora(model) first")


def _load_pair(model: nn.Module, ours: str, config: AdapterConfig, hf_module: str,
               a: torch.Tensor, b: torch.Tensor) -> None:
    rank, alpha = config.rank(hf_module), float(config.alpha(hf_module))
    layer = model.get_submodule(ours)
    if not isinstance(layer, LoraLinear):
        settings = LoraConfig(enabled=True, rank=rank, alpha=alpha,
                              dropout=config.lora_dropout, rslora=config.use_rslora)
        apply_lora(model, settings, module_names=[ours])
        layer = model.get_submodule(ours)
    layer.alpha, layer.rslora, layer.dropout = alpha, config.use_rslora, config.lora_dropout
    rows = fused_rows(model.args, ours, to_hf=False)  # a fused projection's: our order
    copy_into(layer.lora_a, a)
    copy_into(layer.lora_b, b if rows is None else b[rows])



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
    out |= _merged_stacks(model, dtype)
    for key, value in model.state_dict().items():
        module_name = key.rsplit(".", 1)[0]
        if key in out or module_name in replaced or ".quantized." in f"{module_name}." or (
                key.rsplit(".", 1)[-1] in ("lora_a", "lora_b")):
            continue
        value = full_value(value)
        if dtype is not None and value.is_floating_point():
            value = value.to(dtype)
        out[key] = value.cpu()
    return out


def _merged_stacks(model: nn.Module, dtype: Optional[torch.dtype]) -> dict:
    """Each experts' stack that is adapted or quantized: dequantized, plus its adapter."""
    out = {}
    for name, experts in model.named_modules():
        if not isinstance(experts, QuantizableExperts):
            continue
        lora = getattr(experts, "lora", {})
        for target in STACKS:
            if not (experts.is_quantized(target) or target in lora):
                continue
            merged = full_value(experts.base_weight(target, torch.float32))
            if target in lora:
                merged = merged + full_value(lora[target].delta(torch.float32))
            out[f"{name}.{target}"] = merged.to("cpu", dtype or getattr(experts, target).dtype)
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
