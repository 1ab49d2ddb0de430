"""Model families, chosen by Hugging Face's ``model_type`` (config.json) or by a preset.

A family is a folder, ``models/<family>/``: the plain model (``model.py``), its HF
config and parameter names (``hf.py``), its tensor-parallel plan (``plan.py``) and its
named sizes (``presets.py``). It is described to the rest of lmforge by one
``ModelFamily`` here, so nothing outside ``models/`` branches on a family's name: the
trainer, parallelism, LoRA, export and the performance model ask the family of the
model's ``args`` (``family_of``).

Every family's model keeps the same top-level layout (``tok_embeddings``, ``layers`` as
an ``nn.ModuleDict`` keyed by layer id, ``norm``, ``output``; each block with
``attention_norm``, ``attention`` and ``feed_forward``) and its args the same shape
fields (``dim``, ``n_layers``, ``n_heads``, ``n_kv_heads``, ``head_dim``, ``vocab_size``,
``ffn_dim``, ``max_seq_len``, ``tie_embeddings``, ``sliding_window``, ``family``), which is
what pipeline splitting, checkpoints and the memory model rely on.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch
from torch import nn

from lmforge.models import gptj, llama
from lmforge.models.common import Projections
from lmforge.models.mapping import HFCheckpointError


@dataclass(frozen=True)
class ModelFamily:
    name: str  # the folder under models/
    model_types: tuple[str, ...]  # config.json model_type values it loads
    build: Callable[[Any], nn.Module]  # args -> model, on the current default device
    args_from_dict: Callable[[dict], Any]  # dataclasses.asdict(args) -> args (meta.json)
    args_from_hf_config: Callable[[dict, str], Any]
    hf_config: Callable[..., dict]  # (args, **extra fields) -> config.json dict
    hf_names: Callable[[Any], dict[str, str]]  # our parameter name -> HF name
    projections: Projections
    projection_shapes: Callable[[Any], dict[str, tuple[int, int]]]  # (in, out) per block
    block_plan: Callable[[bool], dict]  # sequence_parallel -> {module name: style}
    model_plan: Callable[[bool], dict]
    presets: Mapping[str, Any]
    check_args: Callable[[Any], None]  # shapes the model cannot have -> ConfigError
    as_variant: Callable[[Any, str], Any]  # (args, one of model_types) -> args
    # Whether attention and MLP read the same normalised input in parallel (GPT-J) rather
    # than the MLP reading the attention's output (Llama).
    parallel_block: bool = False
    # HF checkpoint keys that hold buffers rather than weights (ignored on load).
    ignored_hf_suffixes: tuple[str, ...] = ()
    # What the memory estimate (perf/) reads of a block beyond its projections' shapes:
    # the norm ("rms": RMSNorm, a weight; "layer": LayerNorm, a weight and a bias), the
    # MLP ("swiglu": the output projection reads silu(gate) * up; "gelu": gelu_tanh(fc_in)),
    # the features of each head that rotate, the linear layers with a bias (projection
    # names, "output" for the head), and whether q and k pass an RMSNorm over each head
    # before the rotation (Qwen3's q_norm, k_norm: one head_dim weight each).
    norm: str = "rms"
    mlp_activation: str = "swiglu"
    rotary_features: Callable[[Any], int] = lambda args: args.head_dim
    biased_linears: Callable[[Any], tuple[str, ...]] = lambda args: ()
    head_norms: Callable[[Any], bool] = lambda args: False


def _from_folder(package, **family) -> ModelFamily:
    """A family whose folder holds what every family folder does: model.py
    (PROJECTIONS, projection_shapes), hf.py (args_from_hf_config, hf_config_from_args,
    hf_names), plan.py (block_plan, model_plan) and presets.py (PRESETS, check_args)."""
    return ModelFamily(
        args_from_hf_config=package.hf.args_from_hf_config,
        hf_config=package.hf.hf_config_from_args, hf_names=package.hf.hf_names,
        projections=package.model.PROJECTIONS,
        projection_shapes=package.model.projection_shapes,
        block_plan=package.plan.block_plan, model_plan=package.plan.model_plan,
        presets=package.presets.PRESETS, check_args=package.presets.check_args, **family)


LLAMA = _from_folder(
    llama, name="llama", model_types=("llama", "mistral", "qwen2", "qwen3"),
    build=llama.model.Llama, args_from_dict=llama.model.LlamaArgs.from_dict,
    as_variant=llama.hf.as_variant, head_norms=lambda args: args.qk_norm,
    biased_linears=lambda args: ("q_proj", "k_proj", "v_proj") if args.attention_bias else ())

GPTJ = _from_folder(
    gptj, name="gptj", model_types=("gptj",),
    build=gptj.model.GPTJ, args_from_dict=lambda d: gptj.model.GPTJArgs(**d),
    as_variant=lambda args, model_type: args,
    parallel_block=True, ignored_hf_suffixes=gptj.hf.IGNORED_SUFFIXES,
    norm="layer", mlp_activation="gelu", rotary_features=lambda args: args.rotary_features,
    biased_linears=lambda args: ("fc_in", "fc_out", "output"))

FAMILIES: tuple[ModelFamily, ...] = (LLAMA, GPTJ)
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
    ``bos_token_id``, ...); None ids are left out."""
    cfg = family_of(args).hf_config(args) | extra
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if name in cfg and cfg[name] is None:
            del cfg[name]
    return cfg


def hf_names(args: Any) -> dict[str, str]:
    """Our parameter name -> HF name for every tensor an HF checkpoint holds."""
    return family_of(args).hf_names(args)


def preset_family(preset: Optional[str]) -> Optional[ModelFamily]:
    return family_of(PRESETS[preset]) if preset in PRESETS else None
