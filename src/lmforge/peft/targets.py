"""Which linear layers get LoRA: the one rule that reads ``lora.targets`` against the
model family's projections (``models.common.Projections``). The trainer's LoRA swap,
QLoRA's quantization, adapter save/load (peft's ``target_modules``), the FLOPs count and
the memory estimate all resolve targets here.

Unset (None), ``lora.targets`` is the family's default, as peft's: ``q_proj v_proj``
(Phi-3: ``qkv_proj``). The rule, for each entry of ``lora.targets`` (a list, or one string), case and
surrounding spaces ignored:

- a projection name of the family: Llama's and Gemma 3's ``q_proj k_proj v_proj o_proj
  gate_proj up_proj down_proj``, GPT-J's ``q_proj k_proj v_proj out_proj fc_in fc_out``,
  Phi-3's ``qkv_proj o_proj gate_up_proj down_proj`` (fused: a part of one, ``q_proj``,
  is not a layer of its own and is refused); a hybrid's (Qwen3.5) linear-attention layers'
  ``in_proj_qkv in_proj_z in_proj_b in_proj_a out_proj`` beside its full-attention
  layers' ``q_proj`` (whose rows hold each head's query and output gate: one adapter over
  both, as peft's) ``k_proj v_proj o_proj``;
- a linear layer the family's files fuse where we keep its parts apart
  (``Projections.fused_in_files``): Qwen3-Next's ``in_proj_qkvz`` (our ``in_proj_qkv``
  and ``in_proj_z``) and ``in_proj_ba`` (``in_proj_b``, ``in_proj_a``), the names peft's
  users write there: both parts, whose adapters peft reads as one on the fused layer. A
  part alone is a target too (its adapter crosses with zero rows for the other part);
- another name the family gives one: ``q k v o``; for Llama ``gate up down`` and Meta's
  ``wq wk wv wo w1`` (gate) ``w3`` (up) ``w2`` (down); for GPT-J ``out`` and ``o_proj``;
- a module path ending in one of those (``attention.q_proj``, ``self_attn.q_proj``,
  ``mlp.down_proj``, ``mlp.fc_in``): that projection, in every layer;
- a group: ``all-linear`` (every projection, as peft's: not the embedding or the output
  head), ``attention`` (q, k, v and the attention output; a hybrid's linear-attention
  projections too), ``mlp`` (the MLP's); spelled
  also ``all_linear``, ``attn`` / ``self_attn``, ``ffn`` / ``feed_forward``.

A mixture of experts (Qwen3-MoE, Mixtral, ...) adds its experts' stacked weights,
spelled ``experts.gate_up_proj`` and ``experts.down_proj`` (also ``mlp.experts.down_proj``,
and the group ``experts``). There, as peft reads targets on transformers 5's MoE models,
the MLP means the routed experts: ``all-linear`` is the attention and the experts, ``mlp``
the experts, and an MLP projection's name their matching weight (``gate_proj``,
``up_proj``: ``experts.gate_up_proj``, which holds both; ``down_proj``); so the experts are
never left out silently, and every adapter is one peft loads. Dense layers' MLPs (Qwen3-MoE's
``mlp_only_layers``), the router and the shared experts (DeepSeek-V3's; Qwen3-Next's and
Qwen3.5-MoE's, and their gate) take no adapters.

Refused with an error naming ``lora.targets``: anything else, an empty list, ``all``
(it could be read to include the embedding and the head), and a path through one layer
(``layers.0.attention.q_proj``: targets apply to every layer). The result is the
projection names in model order, each once.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from lmforge.config import QUANTIZE_FORMATS, ConfigError, show
from lmforge.models.registry import FAMILIES, Projections, family_of

_GROUPS = {
    "all-linear": "all", "all_linear": "all",
    "attention": "attention", "attn": "attention", "self_attn": "attention",
    "mlp": "mlp", "ffn": "mlp", "feed_forward": "mlp",
}


def resolve_targets(targets: Any, projections: Projections) -> tuple[str, ...]:
    """``lora.targets`` -> the family's projection names in model order (see the module
    docstring); None -> the family's default (``Projections.lora_default``)."""
    if targets is None:
        targets = list(projections.lora_default)
    items = [targets] if isinstance(targets, str) else targets
    if not isinstance(items, (list, tuple)) or not items:
        raise ConfigError(f"lora.targets: expected a list of module names or 'all-linear', "
                          f"got {show(targets)}")
    found: set[str] = set()
    for item in items:
        found.update(_resolve_one(item, projections))
    return tuple(p for p in projections.adaptable if p in found)


def _resolve_one(item: Any, projections: Projections) -> tuple[str, ...]:
    key = str(item).strip().lower()
    if key in _GROUPS:
        return _group(_GROUPS[key], projections)
    if key == "experts" and projections.experts:
        return projections.experts
    path = key.split(".")
    if any(part.isdigit() for part in path):
        raise ConfigError(f"lora.targets: {item!r} names one layer; targets apply to every "
                          f"layer (write {path[-1]!r})")
    if len(path) > 1 and path[-2] == "experts" and f"experts.{path[-1]}" in projections.experts:
        return (f"experts.{path[-1]}",)
    leaf = projections.aliases.get(path[-1], path[-1])
    if leaf in projections.fused_in_files:
        return projections.fused_in_files[leaf]
    expert = projections.experts_for.get(leaf)
    if expert is not None:  # an MLP projection's name: the experts' stacked weight
        return (expert,)
    if leaf in projections.fused_parts:
        fused = projections.fused_parts[leaf]
        raise ConfigError(f"lora.targets: {item!r} is computed inside {fused} in this model "
                          f"(a fused projection, as peft names it): target {fused!r}")
    if leaf not in projections.all:
        raise ConfigError(f"lora.targets: unknown module {item!r} (known: "
                          f"{', '.join(projections.adaptable)}, other names for them "
                          f"({', '.join([*projections.aliases, *projections.fused_in_files])}"
                          f"), paths ending in one, or the "
                          f"groups all-linear, attention, mlp)")
    return (leaf,)


def _group(group: str, projections: Projections) -> tuple[str, ...]:
    """A group's projections: both kinds of attention of a hybrid family; on an MoE family
    the MLP means the routed experts."""
    mixers = projections.attention + projections.linear_attention
    mlp = projections.experts or projections.mlp
    return {"all": mixers + mlp, "attention": mixers, "mlp": mlp}[group]


# Every family's projection names: what a bare module (a block, in tests) may hold.
ANY_FAMILY = Projections(
    attention=tuple(dict.fromkeys(p for f in FAMILIES for p in f.projections.attention)),
    mlp=tuple(dict.fromkeys(p for f in FAMILIES for p in f.projections.mlp)),
    linear_attention=tuple(dict.fromkeys(p for f in FAMILIES
                                         for p in f.projections.linear_attention)),
    lora_default=("q_proj", "v_proj"))


def model_projections(model: Any) -> Projections:
    """The projections of ``model``'s family (a whole model or a pipeline stage); a bare
    module without ``args`` (a block, in tests) is matched against every family's names."""
    args = getattr(model, "args", None)
    return ANY_FAMILY if args is None else family_of(args).projections


def target_modules(module_names: Iterable[str]) -> list[str]:
    """peft's ``target_modules`` for adapters on these (full) module names: their leaf
    names, sorted; peft matches every module whose name ends with one. Our projections'
    leaf names are Hugging Face's (``models.common.Projections``)."""
    return sorted({name.rsplit(".", 1)[-1] for name in module_names})


@dataclass(frozen=True)
class LoraSpec:
    """What the memory estimate and the FLOPs count need to know about LoRA/QLoRA."""
    targets: tuple[str, ...]  # projection names (``resolve_targets``)
    rank: int = 8
    quantize: Optional[str] = None  # None | "nf4" | "int8"
    dropout: float = 0.0
    base_dtype: Optional[str] = None  # storage of unquantized frozen weights; None: auto


def lora_spec(cfg: Any, projections: Projections) -> Optional[LoraSpec]:
    """The ``lora`` section of a JobConfig as a LoraSpec for a model with ``projections``;
    None when absent or disabled. ``lora.targets`` is resolved even when LoRA is off, so a
    bad name is refused either way. Read defensively: the section's fields are optional
    here."""
    section = getattr(cfg, "lora", None)
    if section is None:
        return None
    targets = resolve_targets(getattr(section, "targets", None), projections)
    if not getattr(section, "enabled", True):
        return None
    rank = getattr(section, "rank", None) or getattr(section, "r", None) or 8
    quantize = getattr(section, "quantize", None)
    if isinstance(quantize, str) and quantize.lower() in ("", "none", "null", "bf16"):
        quantize = None
    if quantize is not None and str(quantize).lower() not in QUANTIZE_FORMATS:
        raise ConfigError(f"lora.quantize: {quantize!r} is not one of nf4, int8, none")
    dropout = float(getattr(section, "dropout", 0.0) or 0.0)
    experts = [t for t in targets if t in projections.experts]
    if dropout and experts:
        raise ConfigError(f"lora.dropout: {dropout} cannot apply to the experts' stacked "
                          f"weights ({', '.join(experts)}: their adapter is folded into the "
                          f"weight, as peft's target_parameters); set lora.dropout=0 or "
                          f"leave the experts out of lora.targets")
    spec = LoraSpec(rank=int(rank), targets=targets,
                    dropout=float(getattr(section, "dropout", 0.0) or 0.0),
                    base_dtype=getattr(section, "base_dtype", None))
    return spec if quantize is None else dataclasses.replace(spec, quantize=str(quantize).lower())
