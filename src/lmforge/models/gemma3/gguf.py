"""Gemma 3 (text) as llama.cpp reads it (GGUF architecture ``gemma3``).

llama.cpp's RMSNorm multiplies by its weight where Gemma's multiplies by (1 + weight),
so every norm weight is written plus one, as llama.cpp's own converter does. Which layers
slide is written per layer (``sliding_window_pattern`` as a list), with the sliding
layers' RoPE base (``rope.freq_base_swa``) and the global layers' linear RoPE factor.
llama.cpp scales queries by 1 / sqrt(head_dim) (27B: 1 / sqrt(dim / heads)) whatever
``query_pre_attn_scalar`` says; the difference is folded into the query norm's weight,
which only scales each query (RoPE is linear), so any scalar runs as the model does.
Tensor names come from the gguf package's own table; q and k rotate halves, as stored.
"""
from __future__ import annotations

import math
from typing import Iterator

import torch

from lmforge.models.gemma3.model import SLIDING, Gemma3Args
from lmforge.models.mapping import gguf_tensor_name, write_gguf_shape

GEMMA3_27B_LAYERS = 62  # llama.cpp recognises the 27B by its depth (its query scale)


def architecture(args: Gemma3Args) -> str:
    return "gemma3"


def write_hparams(writer, args: Gemma3Args) -> None:
    write_gguf_shape(writer, args, args.head_dim)
    writer.add_key_length(args.head_dim)
    writer.add_value_length(args.head_dim)
    kinds = args.attention_kinds
    if args.sliding_window and SLIDING in kinds:
        writer.add_sliding_window(args.sliding_window)
        writer.add_sliding_window_pattern([kind == SLIDING for kind in kinds])
        writer.add_rope_freq_base_swa(args.rope_local_theta)
    if args.rope_linear_factor != 1.0:  # global layers only, as llama.cpp applies it
        writer.add_rope_scaling_type(_gguf().RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(args.rope_linear_factor)


def tensors(hf_sd: dict, args: Gemma3Args, name_map) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in hf_sd.items():
        if name == "lm_head.weight" and args.tie_embeddings:
            continue
        if name.endswith("norm.weight"):
            tensor = tensor.float() + 1.0
            if name.endswith("self_attn.q_norm.weight"):
                tensor = tensor * query_scale_correction(args)
        yield gguf_name(name, name_map), tensor


def query_scale_correction(args: Gemma3Args) -> float:
    """The model's query scale over the one llama.cpp applies."""
    theirs = (args.dim // args.n_heads if args.n_layers == GEMMA3_27B_LAYERS
              else args.head_dim)
    return math.sqrt(theirs / args.query_pre_attn_scalar)


gguf_name = gguf_tensor_name  # (what export/gguf.py asks a family for)


def rows_as_gguf(hf_name: str, rows: torch.Tensor, args: Gemma3Args) -> torch.Tensor:
    return rows  # llama.cpp's gemma3 rotates halves, as HF stores the rows


def _gguf():
    import gguf  # optional: only a GGUF export reaches here (export/gguf.py checks it)

    return gguf
