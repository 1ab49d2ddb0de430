"""Mixtral as llama.cpp reads it (GGUF architecture ``llama``, which runs a mixture of
experts where a layer has them): Mistral's attention, with q and k rows back in the
interleaved order llama.cpp's ``llama`` rotates (``models/llama/gguf.py``), and each
layer's experts stacked into one tensor per projection (``ffn_gate_exps``,
``ffn_up_exps``, ``ffn_down_exps``, from the files' w1, w3, w2) beside the router
(``ffn_gate_inp``), as llama.cpp's own converter stacks them. Tensor names come from the
gguf package's own table. As for Mistral, llama.cpp's ``llama`` does not apply a sliding
window: the GGUF model attends to its whole context.
"""
from __future__ import annotations

from typing import Iterator

import torch

from lmforge.models.llama.model import half_to_interleaved
from lmforge.models.mapping import gguf_tensor_name, write_gguf_shape
from lmforge.models.qwen3_moe.gguf import (moe_unsupported, with_experts_stacked,
                                           write_expert_counts)
from lmforge.models.qwen3_moe.model import SparseArgs


def architecture(args: SparseArgs) -> str:
    return "llama"


def unsupported(args: SparseArgs) -> str:
    """Why this model has no GGUF form ("" when it has one)."""
    return moe_unsupported(args, "llama") or (
        "" if args.rope_scaling is None else
        "its RoPE scaling is not written to GGUF for Mixtral yet")


def write_hparams(writer, args: SparseArgs) -> None:
    """The shape keys llama.cpp's converter writes for Mixtral (Llama's, and the expert
    counts; an expert's width is ``feed_forward_length``, config.json's intermediate_size)."""
    write_gguf_shape(writer, args, args.head_dim)
    writer.add_vocab_size(args.vocab_size)
    if args.head_dim != args.dim // args.n_heads:
        writer.add_key_length(args.head_dim)
        writer.add_value_length(args.head_dim)
    write_expert_counts(writer, args)


def tensors(hf_sd: dict, args: SparseArgs, name_map) -> Iterator[tuple[str, torch.Tensor]]:
    """(GGUF name, tensor) of every weight; ``name_map``: the gguf package's
    ``TensorNameMap`` for ``llama``."""
    for name, tensor in with_experts_stacked(hf_sd):
        if name == "lm_head.weight" and args.tie_embeddings:
            continue  # llama.cpp reads a missing output as the token embedding
        yield gguf_name(name, name_map), rows_as_gguf(name, tensor, args)


gguf_name = gguf_tensor_name  # (what export/gguf.py asks a family for)


def rows_as_gguf(hf_name: str, rows: torch.Tensor, args: SparseArgs) -> torch.Tensor:
    """A q or k projection's output rows (its weight, or a LoRA adapter's B) in the order
    llama.cpp's ``llama`` rotates; anything else as it is."""
    heads = (args.n_heads if ".self_attn.q_proj." in hf_name else
             args.n_kv_heads if ".self_attn.k_proj." in hf_name else None)
    if heads is None:
        return rows
    return half_to_interleaved(rows.reshape(rows.shape[0], -1), heads).reshape(rows.shape)
