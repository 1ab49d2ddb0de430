"""The experts' part of a peft adapter directory: ``target_parameters`` naming a mixture of
experts' stacked weights (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``: what
peft's ``lora.ParamWrapper`` adapts on transformers 5's MoE models), checked against the
base model; their tensors taken out of the adapter layer by layer and checked (peft's
keys, ``expert_lora.peft_names``; shapes (experts * r, in) and (out, r * experts) for the
base's stacks and ``r`` / ``rank_pattern``); and loaded into an lmforge model
(``LoraGroupedExperts`` where missing, ``expert_lora.from_peft`` in the family's
``expert_layout``).

peft matches a ``target_parameters`` entry against each parameter's full name (equal, or
ending with ``.`` + the entry) in every layer: ``layers_to_transform`` and
``exclude_modules`` do not apply to it, here as there. An entry that matches anything
but an experts' stack (a linear's weight, a router, a bias) is refused. Every path that
loads an adapter reads it through ``checked_tensors`` (``adapters.load_adapter``).
"""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from lmforge.models.mapping import first_nonfinite
from lmforge.models.moe import GroupedExperts
from lmforge.models.registry import family_of, hf_names
from lmforge.peft.adapter_spec import (AdapterConfig, AdapterError, adapter_linears,
                                       adapter_pairs, check_against_base)
from lmforge.peft.expert_lora import (EXPERT_TARGETS, LoraGroupedExperts, apply_expert_lora,
                                      from_peft, peft_names)
from lmforge.peft.scaling import PEFT_PREFIX, copy_into


class ExpertStack(NamedTuple):
    """A stacked expert weight of the base model that takes adapters."""
    experts: str  # our experts module: layers.3.feed_forward.experts
    target: str  # gate_up_proj | down_proj
    n_experts: int
    in_features: int
    out_features: int


class ExpertAdapter(NamedTuple):
    """One MoE layer's adapters, as the adapter file holds them (checked)."""
    experts: str  # our experts module
    prefix: str  # its HF block with a trailing dot: model.layers.3.mlp.
    n_experts: int
    targets: tuple[str, ...]  # the adapted stacks, in peft's nesting order
    ranks: tuple[int, ...]  # per target
    alphas: tuple[float, ...]  # per target
    tensors: dict[str, torch.Tensor]  # peft's keys


def expert_stacks(args) -> dict[str, ExpertStack]:
    """HF parameter name (``model.layers.3.mlp.experts.down_proj``) -> each experts'
    stack of a model with ``args``; {} for a dense model."""
    moe = family_of(args).block(args).moe
    if moe is None:
        return {}
    shapes = {"gate_up_proj": (moe.dim, 2 * moe.ffn_dim), "down_proj": (moe.ffn_dim, moe.dim)}
    out = {}
    for ours, theirs in hf_names(args).items():
        module, _, target = ours.rpartition(".")
        if ours.startswith("layers.") and module.endswith(".experts") and target in shapes:
            out[theirs] = ExpertStack(module, target, moe.n_experts, *shapes[target])
    return out


def _matches(entry: str, name: str) -> bool:
    """peft's ``_inject_parameters`` rule."""
    return name == entry or name.endswith(f".{entry}")


def check_target_parameters(config: AdapterConfig, args,
                            stacks: dict[str, ExpertStack]) -> None:
    """Every ``target_parameters`` entry names experts' stacks of the base model, and
    nothing else."""
    names = list(hf_names(args).values())
    inside = sorted({name.split(".", 3)[-1] for name in stacks})  # past model.layers.{i}.
    known = (f"lmforge adapts {', '.join(inside)}" if inside
             else "the base model has no MoE experts")
    for entry in config.target_parameters or ():
        matched = [name for name in names if _matches(entry, name)]
        other = next((name for name in matched if name not in stacks), None)
        if not matched or other is not None:
            what = (f"matches {other}, not an experts' stacked weight" if other
                    else "matches no parameter of the base model")
            raise AdapterError(f"{config.path}: target_parameters: {entry!r} {what} "
                               f"({known})")


# ------------------------------------------------------------------ the tensors

def checked_tensors(config: AdapterConfig, sd: dict[str, torch.Tensor], args, source: Path
                    ) -> tuple[dict, list[ExpertAdapter]]:
    """(HF linear module -> (lora_A, lora_B), the MoE layers' ``ExpertAdapter``s): every
    tensor of ``sd`` (read from ``source``) checked against ``config`` and the base model
    of ``args``, before anything is loaded."""
    linears = adapter_linears(args)
    check_against_base(config, linears, args.n_layers)
    stacks = expert_stacks(args)
    check_target_parameters(config, args, stacks)
    experts, rest = _take_experts(config, sd, stacks, source)
    pairs = adapter_pairs(config, rest, linears, source, allow_empty=bool(experts))
    nonfinite = first_nonfinite({k: t for e in experts for k, t in e.tensors.items()})
    if nonfinite is not None:
        raise AdapterError(f"{source}: tensor {nonfinite} holds NaN or Inf values")
    return pairs, experts


def _take_experts(config: AdapterConfig, sd: dict[str, torch.Tensor],
                  stacks: dict[str, ExpertStack], source: Path):
    """(the ``ExpertAdapter`` of each MoE layer the adapter holds, the other tensors)."""
    rest = dict(sd)
    found = []
    for layer in _by_experts_module(stacks).values():  # target -> HF parameter name
        targets = tuple(t for t in EXPERT_TARGETS if t in layer and any(
            _matches(entry, layer[t]) for entry in config.target_parameters or ()))
        if not targets:
            continue
        prefix = layer[targets[0]].removesuffix(f"experts.{targets[0]}")
        keys = peft_names(targets, prefix)  # ours -> peft's
        tensors = {key: rest.pop(key) for key in keys.values() if key in rest}
        if not tensors:
            continue  # (a layer the adapter leaves out, as for linears)
        missing = next((key for key in keys.values() if key not in tensors), None)
        if missing is not None:
            raise AdapterError(f"{source}: {missing} is missing (target_parameters "
                               f"{list(config.target_parameters)} adapt {', '.join(targets)} "
                               f"in {prefix}experts)")
        adapter = ExpertAdapter(stacks[layer[targets[0]]].experts, prefix,
                                stacks[layer[targets[0]]].n_experts, targets,
                                tuple(config.rank(layer[t]) for t in targets),
                                tuple(float(config.alpha(layer[t])) for t in targets), tensors)
        for target in targets:
            _check_shapes(config, adapter, target, stacks[layer[target]], layer[target],
                          source)
        found.append(adapter)
    _refuse_strays(config, rest, stacks, source)
    return found, rest


def _by_experts_module(stacks: dict[str, ExpertStack]) -> dict[str, dict[str, str]]:
    layers: dict[str, dict[str, str]] = {}
    for name, stack in stacks.items():
        layers.setdefault(stack.experts, {})[stack.target] = name
    return layers


def _check_shapes(config: AdapterConfig, adapter: ExpertAdapter, target: str,
                  stack: ExpertStack, name: str, source: Path) -> None:
    keys = peft_names(adapter.targets, adapter.prefix)
    a = adapter.tensors[keys[f"experts.lora.{target}.lora_a"]]
    b = adapter.tensors[keys[f"experts.lora.{target}.lora_b"]]
    for ab, t in (("A", a), ("B", b)):
        if t.ndim != 2 or not t.is_floating_point():
            raise AdapterError(f"{source}: {name} lora_{ab} is a {t.ndim}-d {t.dtype} "
                               f"tensor; a floating-point matrix is needed")
    rank, e = adapter.ranks[adapter.targets.index(target)], stack.n_experts
    expected = ((e * rank, stack.in_features), (stack.out_features, rank * e))
    if (tuple(a.shape), tuple(b.shape)) != expected:
        key = "rank_pattern" if rank != config.r else "r"
        raise AdapterError(f"{source}: {name} lora_A/lora_B shapes {tuple(a.shape)}/"
                           f"{tuple(b.shape)}, expected {expected[0]}/{expected[1]} ({e} "
                           f"experts of rank {rank} ({key}); the base's stack is {e} x "
                           f"{stack.in_features} -> {stack.out_features})")


def _refuse_strays(config: AdapterConfig, rest: dict, stacks: dict[str, ExpertStack],
                   source: Path) -> None:
    """A tensor under an experts module that is none of the adapters target_parameters
    names (another nesting, another stack) is refused, not read as a linear's."""
    modules = {PEFT_PREFIX + name.rpartition(".")[0] + "." for name in stacks}
    stray = next((key for key in rest if any(key.startswith(m) for m in modules)), None)
    if stray is not None:
        raise AdapterError(f"{source}: {stray} is not an adapter of the experts' weights "
                           f"target_parameters names "
                           f"({list(config.target_parameters or [])})")


# ------------------------------------------------------------------ the model

def present_experts(model: nn.Module, adapters: list[ExpertAdapter], strict: bool,
                    source: Path) -> list[ExpertAdapter]:
    """The adapters whose experts ``model`` holds (all, when ``strict``), each checked to
    fit the experts' adapters the model has already."""
    modules = dict(model.named_modules())
    present = [a for a in adapters if a.experts in modules]
    if strict and len(present) < len(adapters):
        missing = next(a for a in adapters if a.experts not in modules)
        raise AdapterError(f"{source}: {missing.prefix}experts has no matching module in "
                           f"the model")
    for adapter in present:
        experts = modules[adapter.experts]
        if not isinstance(experts, GroupedExperts):
            raise AdapterError(f"{source}: {adapter.experts} is a {type(experts).__name__}, "
                               f"not grouped experts")
        lora = experts.lora if isinstance(experts, LoraGroupedExperts) else {}
        for target, rank in zip(adapter.targets, adapter.ranks):
            if target in lora and lora[target].rank != rank:
                raise AdapterError(f"{source}: {adapter.prefix}experts.{target} has rank "
                                   f"{rank} but the model's adapter has rank "
                                   f"{lora[target].rank}")
    return present


def load_experts(model: nn.Module, adapters: list[ExpertAdapter], config: AdapterConfig
                 ) -> None:
    """Each (checked, present) adapter into its experts: ``LoraGroupedExperts`` where the
    model has none, an adapter added where a target lacks one."""
    layout = family_of(model.args).expert_layout
    for adapter in adapters:
        moe = model.get_submodule(adapter.experts.rpartition(".")[0])
        if not isinstance(moe.experts, LoraGroupedExperts):
            apply_expert_lora(moe, adapter.targets, adapter.ranks[0], adapter.alphas[0],
                              rslora=config.use_rslora)
        experts = moe.experts
        for target, rank, alpha in zip(adapter.targets, adapter.ranks, adapter.alphas):
            if target not in experts.lora or experts.lora[target].rank != rank:
                experts.add_adapter(target, rank, alpha, config.use_rslora)
            experts.lora[target].alpha = alpha
            experts.lora[target].rslora = config.use_rslora
        values = from_peft(adapter.tensors, adapter.prefix, adapter.n_experts,
                           adapter.targets, layout)
        for name, value in values.items():  # experts.lora.<target>.lora_a / lora_b
            copy_into(experts.get_parameter(name.removeprefix("experts.")), value)
