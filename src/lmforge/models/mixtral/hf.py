"""Hugging Face's Mixtral <-> lmforge's ``SparseLlama``. config.json's fields and the
in-memory names are Qwen3-MoE's mapping (``models/qwen3_moe/hf.py``, whose ``EXPERTS``
table has Mixtral's keys); what is Mixtral's own is the checkpoint files' names, those of
the released checkpoints, which transformers 5's ``save_pretrained`` writes too:
``model.layers.{i}.block_sparse_moe.gate.weight`` (the router) and
``block_sparse_moe.experts.{e}.w1/w3/w2.weight`` (gate, up, down), one tensor per expert.
They are checked, renamed and stacked on load, and split and named back on export, so an
export's files hold the original keys and tensors."""
from __future__ import annotations

import re

import torch

from lmforge.models.mapping import HFCheckpointError
from lmforge.models.moe_hf import checkpoint_from_hf, checkpoint_to_hf
from lmforge.models.qwen3_moe.hf import (args_from_hf_config, hf_config_from_args, hf_names,
                                         rope_scaling_from)
from lmforge.models.qwen3_moe.model import SparseArgs

__all__ = ["args_from_hf_config", "checkpoint_in", "checkpoint_out", "hf_config_from_args",
           "hf_names", "rope_scaling_from"]

_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}  # file -> transformers 5
_W = {proj: w for w, proj in _PROJ.items()}
# A router or expert tensor in transformers 5's names (``models/moe_hf.py``'s per-expert
# layout), and in the files'.
_MEMORY_NAME = re.compile(
    r"(model\.layers\.\d+\.)mlp\.(gate|experts\.\d+\.(gate_proj|up_proj|down_proj))\.weight")
_FILE_NAME = re.compile(
    r"(model\.layers\.\d+\.)block_sparse_moe\.(gate|experts\.\d+\.(w1|w3|w2))\.weight")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def _file_shapes(args: SparseArgs) -> dict[str, tuple[int, int]]:
    """Each router and expert tensor a Mixtral checkpoint file holds -> its shape."""
    d, f = args.dim, args.moe_ffn_dim
    shapes = {}
    for i in args.sparse_layers:
        layer = f"model.layers.{i}.block_sparse_moe"
        shapes[f"{layer}.gate.weight"] = (args.n_experts, d)
        for e in range(args.n_experts):
            shapes |= {f"{layer}.experts.{e}.w1.weight": (f, d),
                       f"{layer}.experts.{e}.w3.weight": (f, d),
                       f"{layer}.experts.{e}.w2.weight": (d, f)}
    return shapes


def _expert(name: str) -> int:
    """The expert a file's tensor belongs to; -1 for the router and any other tensor."""
    match = _FILE_NAME.fullmatch(name) and _EXPERT.search(name)
    return int(match[1]) if match else -1


def _check_file(sd: dict, shapes: dict, n_experts: int, source: str) -> None:
    """Refuse, naming the file's tensor, an expert beyond the config's count, and a
    router or expert tensor missing or misshaped (any other tensor the model lacks is
    the loader's to refuse)."""
    beyond = next((name for name in sd if _expert(name) >= n_experts), None)
    missing = next((name for name in shapes if name not in sd), None)
    for name, problem in ((beyond, "unexpected"), (missing, "missing")):
        if name is not None:
            raise HFCheckpointError(f"{source}: {name}: {problem}, with {n_experts} experts "
                                    f"in the config")
    for name, shape in shapes.items():
        if tuple(sd[name].shape) != shape:
            raise HFCheckpointError(f"{source}: {name}: shape {tuple(sd[name].shape)} "
                                    f"(expected {shape})")


def _rename(name: str, pattern: re.Pattern, parts: dict[str, str], block: str) -> str:
    """A router or expert tensor's name (``pattern``'s) under ``block`` with the expert
    projections renamed by ``parts``; any other name unchanged."""
    match = pattern.fullmatch(name)
    if match is None:
        return name
    leaf = match[2] if match[3] is None else match[2][:-len(match[3])] + parts[match[3]]
    return f"{match[1]}{block}.{leaf}.weight"


def checkpoint_in(sd: dict[str, torch.Tensor], args: SparseArgs,
                  source: str) -> dict[str, torch.Tensor]:
    """A Mixtral checkpoint's tensors in transformers 5's names, each layer's experts
    stacked. Only the tensors the config expects are renamed: any other stays in the
    file's name, which the loader's refusal then quotes."""
    shapes = _file_shapes(args)
    _check_file(sd, shapes, args.n_experts, source)
    renamed = {(_rename(k, _FILE_NAME, _PROJ, "mlp") if k in shapes else k): v
               for k, v in sd.items()}
    return checkpoint_from_hf(renamed, "per_expert", args.n_experts, source)


def checkpoint_out(sd: dict[str, torch.Tensor], args: SparseArgs) -> dict[str, torch.Tensor]:
    """The stacked expert weights split per expert, in the released files' names."""
    return {_rename(k, _MEMORY_NAME, _W, "block_sparse_moe"): v
            for k, v in checkpoint_to_hf(sd, "per_expert").items()}
