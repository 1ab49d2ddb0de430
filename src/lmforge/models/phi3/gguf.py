"""Phi-3 / Phi-4-mini as llama.cpp reads them (GGUF architecture ``phi3``): the fused
``qkv_proj`` and ``gate_up_proj`` stay fused (llama.cpp's ``attn_qkv`` splits q, k, v in
HF's order, and its ``ffn_up`` gates with the first half, as HF does), the rotary
dimension is the rotating part of each head, and LongRoPE's factors become the
``rope_factors_short`` / ``rope_factors_long`` tensors with their attention factor.
Tensor names come from the gguf package's own table. llama.cpp's phi3 attends to its
whole context: a sliding window is not applied (the docs say so)."""
from __future__ import annotations

from typing import Iterator

import torch

from lmforge.models.mapping import gguf_tensor_name, write_gguf_shape
from lmforge.models.phi3.model import Phi3Args


def architecture(args: Phi3Args) -> str:
    return "phi3"


def write_hparams(writer, args: Phi3Args) -> None:
    write_gguf_shape(writer, args, args.rotary_dim)
    rope = args.rope_scaling
    if rope is not None:
        writer.add_rope_scaling_attn_factors(rope.attention_factor)
        writer.add_rope_scaling_orig_ctx_len(rope.original_max_position_embeddings)


def tensors(hf_sd: dict, args: Phi3Args, name_map) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in hf_sd.items():
        if name == "lm_head.weight" and args.tie_embeddings:
            continue
        yield gguf_name(name, name_map), tensor
    rope = args.rope_scaling
    if rope is not None:  # LongRoPE: the divisors of the rotary frequencies
        yield "rope_factors_short.weight", torch.tensor(rope.short_factor, dtype=torch.float32)
        yield "rope_factors_long.weight", torch.tensor(rope.long_factor, dtype=torch.float32)


gguf_name = gguf_tensor_name  # (what export/gguf.py asks a family for)


def rows_as_gguf(hf_name: str, rows: torch.Tensor, args: Phi3Args) -> torch.Tensor:
    return rows  # llama.cpp's phi3 rotates halves, as HF stores the rows
