"""Qwen3-MoE as llama.cpp reads it (GGUF architecture ``qwen3moe``): Qwen3's attention
(q/k norms, an explicit head_dim; q and k rotate halves, as stored) and each layer's
experts stacked into one tensor per projection (``ffn_gate_exps``, ``ffn_up_exps``,
``ffn_down_exps``: (experts, out, in)) beside the router (``ffn_gate_inp``), as llama.cpp's
own converter stacks the checkpoint files' per-expert tensors. Tensor names come from the
gguf package's own table.

llama.cpp's qwen3moe puts experts in every layer and always rescales the chosen experts'
weights to sum to 1: a model with dense layers (``mlp_only_layers``,
``decoder_sparse_step``) or with ``norm_topk_prob`` false has no GGUF form here.
"""
from __future__ import annotations

import re
from typing import Iterator

import torch

from lmforge.models.mapping import gguf_tensor_name, write_gguf_shape
from lmforge.models.qwen3_moe.model import SparseArgs

# One expert's weight in a checkpoint file: (its layer's experts, the expert, the projection)
_EXPERT = re.compile(r"(model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts)\.(\d+)\.(\w+)"
                     r"\.weight")


def architecture(args: SparseArgs) -> str:
    return "qwen3moe"


def unsupported(args: SparseArgs) -> str:
    """Why this model has no GGUF form ("" when it has one)."""
    return moe_unsupported(args, "qwen3moe") or (
        "" if args.rope_scaling is None else
        "its RoPE scaling is not written to GGUF for Qwen3-MoE yet")


def moe_unsupported(args: SparseArgs, arch: str) -> str:
    """What llama.cpp's ``arch`` (experts in every layer, the chosen weights always
    rescaled to sum to 1) cannot run of a ``SparseArgs`` model."""
    if args.dense_layers:
        return (f"layers {list(args.dense_layers)} have a dense MLP (mlp_only_layers / "
                f"decoder_sparse_step), and llama.cpp's {arch} has experts in every layer")
    if not args.norm_topk_prob:
        return (f"norm_topk_prob is false, and llama.cpp's {arch} always rescales the chosen "
                f"experts' weights to sum to 1")
    return ""


def write_hparams(writer, args: SparseArgs) -> None:
    """The shape keys llama.cpp reads for qwen3moe (``feed_forward_length``: the dense
    width config.json gives, as the converter writes it; the experts' own width apart)."""
    write_gguf_shape(writer, args, args.head_dim)
    write_expert_counts(writer, args)
    writer.add_expert_feed_forward_length(args.moe_ffn_dim)


def write_expert_counts(writer, args) -> None:
    writer.add_expert_count(args.n_experts)
    writer.add_expert_used_count(args.top_k)


def tensors(hf_sd: dict, args: SparseArgs, name_map) -> Iterator[tuple[str, torch.Tensor]]:
    """(GGUF name, tensor) of every weight; ``name_map``: the gguf package's
    ``TensorNameMap`` for this architecture."""
    for name, tensor in with_experts_stacked(hf_sd):
        if name == "lm_head.weight" and args.tie_embeddings:
            continue  # llama.cpp reads a missing output as the token embedding
        yield gguf_name(name, name_map), tensor


def with_experts_stacked(hf_sd: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint file's tensors with each layer's per-expert weights stacked, expert
    by expert, under the name without the expert's number (``...experts.gate_proj.weight``,
    the name the gguf package's table gives the stacked tensor); the others as they are.
    (The export has checked that every expert is there.)"""
    stacks: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in hf_sd.items():
        match = _EXPERT.fullmatch(name)
        if match is None:
            yield name, tensor
        else:
            stacks.setdefault(f"{match[1]}.{match[3]}.weight", {})[int(match[2])] = tensor
    for name, experts in stacks.items():
        yield name, torch.stack([experts[e] for e in sorted(experts)])


gguf_name = gguf_tensor_name  # (what export/gguf.py asks a family for)


def rows_as_gguf(hf_name: str, rows: torch.Tensor, args: SparseArgs) -> torch.Tensor:
    return rows  # llama.cpp's qwen3moe rotates halves, as HF stores the rows
