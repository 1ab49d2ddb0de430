"""The MoE block's tensors (``models/moe.py``) to and from each family's Hugging Face
names and layouts: pure functions over one block's state dict, names relative to the
layer's ``mlp.``, which a family's ``hf.py`` prefixes and checks
(``mapping.remap_state_dict``)."""
from __future__ import annotations

import re
from typing import Optional

import torch

from lmforge.models.mapping import HFCheckpointError

HF_LAYOUTS = ("fused", "gpt_oss", "per_expert")
_PER_EXPERT = re.compile(r"experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


# (an image-text model's language model sits under model.language_model.: Qwen3.5-MoE's)
_LAYER_MLP = re.compile(r"(model\.(?:language_model\.)?layers\.\d+\.mlp\.)(.+)")


def check_top_k(top_k: int, n_experts: int, source: str,
                experts_key: str = "num_experts") -> None:
    """config.json's ``num_experts_per_tok`` within its expert count (``experts_key``)."""
    if top_k > n_experts:
        raise HFCheckpointError(f"{source}: num_experts_per_tok: {top_k} exceeds the "
                                f"{n_experts} experts ({experts_key}): a token cannot "
                                f"choose more experts than there are")


def checkpoint_from_hf(sd: dict[str, torch.Tensor], layout: str, n_experts: int,
                       source: str) -> dict[str, torch.Tensor]:
    """A whole checkpoint's tensors with each layer's ``model.layers.{i}.mlp.*`` through
    ``from_hf`` (a dense layer's MLP passes unchanged); a missing expert is refused
    naming its tensor and ``source``."""
    out, blocks = _split_layer_mlps(sd)
    for prefix, block in blocks.items():
        try:
            converted = from_hf(block, layout, n_experts)
        except ValueError as e:
            raise HFCheckpointError(f"{source}: {prefix}{e}") from None
        out.update({prefix + k: v for k, v in converted.items()})
    return out


def checkpoint_to_hf(sd: dict[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    """``checkpoint_from_hf``'s inverse over a whole state dict in HF names."""
    out, blocks = _split_layer_mlps(sd)
    for prefix, block in blocks.items():
        converted = to_hf(block, layout) if "experts.down_proj" in block else block
        out.update({prefix + k: v for k, v in converted.items()})
    return out


def _split_layer_mlps(sd: dict[str, torch.Tensor]) -> tuple[dict, dict[str, dict]]:
    """(the tensors outside every layer's MLP, {``model.layers.{i}.mlp.``: that MLP's
    tensors by their names inside it})."""
    out, blocks = {}, {}
    for name, t in sd.items():
        match = _LAYER_MLP.fullmatch(name)
        if match is None:
            out[name] = t
        else:
            blocks.setdefault(match[1], {})[match[2]] = t
    return out, blocks


def from_hf(sd: dict[str, torch.Tensor], layout: str,
            n_experts: Optional[int] = None) -> dict[str, torch.Tensor]:
    """One block's Hugging Face tensors (names relative to the layer's ``mlp.``) in the
    block's own names and layout. ``layout``:

    - ``fused``: transformers 5's modules for Qwen3-MoE, Mixtral, DeepSeek-V3, which are
      ours (the identity);
    - ``gpt_oss``: ``router.*`` for ``gate.*``; ``experts.gate_up_proj`` (experts, dim,
      2 ffn) in x out with gate and up columns interleaved (gate even, up odd), likewise
      its bias, and ``experts.down_proj`` (experts, ffn, dim): transposed and split;
    - ``per_expert``: the checkpoint files of Qwen3-MoE and DeepSeek-V3 (Mixtral's after
      the family renames w1, w3, w2 to gate_proj, up_proj, down_proj):
      ``experts.{e}.{gate,up,down}_proj.weight``, stacked; ``n_experts`` (when given)
      is how many there must be.
    """
    if layout == "fused":
        return dict(sd)
    if layout == "gpt_oss":
        return {_from_gpt_oss_name(k): _from_gpt_oss(k, v) for k, v in sd.items()}
    if layout == "per_expert":
        return _stack_experts(sd, n_experts)
    raise ValueError(f"layout: {layout!r} is not one of {', '.join(HF_LAYOUTS)}")


def to_hf(sd: dict[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    """``from_hf``'s inverse: ``to_hf(from_hf(sd, layout), layout) == sd``."""
    if layout == "fused":
        return dict(sd)
    if layout == "gpt_oss":
        return {re.sub(r"^gate\.", "router.", k): _to_gpt_oss(k, v) for k, v in sd.items()}
    if layout == "per_expert":
        return _unstack_experts(sd)
    raise ValueError(f"layout: {layout!r} is not one of {', '.join(HF_LAYOUTS)}")


def _from_gpt_oss_name(name: str) -> str:
    return re.sub(r"^router\.", "gate.", name)


def _from_gpt_oss(name: str, t: torch.Tensor) -> torch.Tensor:
    if name == "experts.gate_up_proj":  # (experts, dim, 2 ffn) interleaved
        t = t.transpose(1, 2)  # (experts, 2 ffn, dim)
    if name in ("experts.gate_up_proj", "experts.gate_up_proj_bias"):
        return torch.cat((t[:, 0::2], t[:, 1::2]), dim=1).contiguous()  # gate rows, then up
    if name == "experts.down_proj":  # (experts, ffn, dim)
        return t.transpose(1, 2).contiguous()  # (experts, dim, ffn)
    return t


def _to_gpt_oss(name: str, t: torch.Tensor) -> torch.Tensor:
    if name in ("experts.gate_up_proj", "experts.gate_up_proj_bias"):
        gate, up = t.chunk(2, dim=1)
        t = torch.stack((gate, up), dim=2).flatten(1, 2)  # rows interleaved: gate, up, ...
    if name in ("experts.gate_up_proj", "experts.down_proj"):
        return t.transpose(1, 2).contiguous()
    return t


def _stack_experts(sd: dict[str, torch.Tensor],
                   n_experts: Optional[int]) -> dict[str, torch.Tensor]:
    out, parts = {}, {}
    for name, t in sd.items():
        match = _PER_EXPERT.fullmatch(name)
        if match is None:
            out[name] = t
        else:
            parts.setdefault(match[2], {})[int(match[1])] = t
    if parts:
        found = 1 + max(max(experts) for experts in parts.values())
        n = found if n_experts is None else n_experts
        if found > n:
            raise ValueError(f"experts.{found - 1}: unexpected, with {n} experts in the "
                             f"config")
        for proj in ("gate_proj", "up_proj", "down_proj"):
            missing = [e for e in range(n) if e not in parts.get(proj, {})]
            if missing:
                raise ValueError(f"experts.{missing[0]}.{proj}.weight: missing, with "
                                 f"{n} experts in the {'config' if n_experts else 'checkpoint'}")
        for proj, experts in parts.items():  # (torch.stack would fail with no name)
            shape = experts[0].shape
            odd = next((e for e in range(n) if experts[e].shape != shape), None)
            if odd is not None:
                raise ValueError(f"experts.{odd}.{proj}.weight: shape "
                                 f"{tuple(experts[odd].shape)}, expert 0's is {tuple(shape)}")
        stacked = {p: torch.stack([parts[p][e] for e in range(n)]) for p in parts}
        out["experts.gate_up_proj"] = torch.cat((stacked["gate_proj"], stacked["up_proj"]), 1)
        out["experts.down_proj"] = stacked["down_proj"]
    return out


def _unstack_experts(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {k: v for k, v in sd.items() if k not in ("experts.gate_up_proj", "experts.down_proj")}
    for e, (gate_up, down) in enumerate(zip(sd["experts.gate_up_proj"], sd["experts.down_proj"])):
        gate, up = gate_up.chunk(2, dim=0)
        out[f"experts.{e}.gate_proj.weight"] = gate.contiguous()
        out[f"experts.{e}.up_proj.weight"] = up.contiguous()
        out[f"experts.{e}.down_proj.weight"] = down.contiguous()
    return out
