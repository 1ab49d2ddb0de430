"""Llama, Mistral, Qwen2/2.5 and Qwen3 as llama.cpp reads them (GGUF): its architecture,
its shape keys, and the tensors of a Hugging Face state dict under its names, taken from
the ``gguf`` package's own table (``TensorNameMap``), not a copy of it.

llama.cpp's ``llama`` architecture (Llama, and Mistral, which it runs as Llama) rotates
adjacent feature pairs, so q and k rows go back to the interleaved order Meta's weights
use (Hugging Face stores them rotating halves); ``qwen2`` and ``qwen3`` rotate halves, as
stored. Llama 3.1's RoPE scaling becomes a ``rope_freqs`` tensor of per-frequency
divisors, as llama.cpp reads it. Mistral's sliding window is not applied by llama.cpp's
``llama`` architecture: the GGUF model attends to its whole context (the docs say so).
"""
from __future__ import annotations

from typing import Iterator

import torch

from lmforge.models.llama.model import LlamaArgs, half_to_interleaved, rope_frequencies
from lmforge.models.mapping import gguf_tensor_name, write_gguf_shape

# HF model_type -> llama.cpp architecture name
ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def architecture(args: LlamaArgs) -> str:
    return ARCHITECTURES[args.family]


def unsupported(args: LlamaArgs) -> str:
    """Why this model has no GGUF form ("" when it has one)."""
    if args.rope_scaling is not None and args.rope_scaling.kind == "yarn":
        # its cos/sin scale has no place in a rope_freqs tensor, and llama.cpp's own YaRN
        # keys are not verified against transformers' here
        return "its YaRN RoPE scaling is not written to GGUF yet"
    return ""


def write_hparams(writer, args: LlamaArgs) -> None:
    """The shape keys llama.cpp reads for this architecture."""
    write_gguf_shape(writer, args, args.head_dim)
    if architecture(args) == "llama":  # as llama.cpp's converter writes Llama's
        writer.add_vocab_size(args.vocab_size)
    if args.head_dim != args.dim // args.n_heads:  # Qwen3: heads sized apart from dim
        writer.add_key_length(args.head_dim)
        writer.add_value_length(args.head_dim)


def tensors(hf_sd: dict, args: LlamaArgs, name_map) -> Iterator[tuple[str, torch.Tensor]]:
    """(GGUF name, tensor) of every weight; ``name_map``: the gguf package's
    ``TensorNameMap`` for this architecture."""
    for name, tensor in hf_sd.items():
        if name == "lm_head.weight" and args.tie_embeddings:
            continue  # llama.cpp reads a missing output as the token embedding
        yield gguf_name(name, name_map), rows_as_gguf(name, tensor, args)
    if args.rope_scaling is not None:  # Llama 3.1, linear: each rotary frequency's divisor
        plain = LlamaArgs(**{**args.__dict__, "rope_scaling": None})
        yield "rope_freqs.weight", (rope_frequencies(plain) / rope_frequencies(args)).float()


gguf_name = gguf_tensor_name  # (what export/gguf.py asks a family for)


def rows_as_gguf(hf_name: str, rows: torch.Tensor, args: LlamaArgs) -> torch.Tensor:
    """A q or k projection's output rows (its weight, or a LoRA adapter's B) in the order
    llama.cpp's ``llama`` architecture rotates; anything else as it is."""
    if architecture(args) != "llama" or not hf_name.startswith("model.layers."):
        return rows
    heads = (args.n_heads if ".self_attn.q_proj." in hf_name else
             args.n_kv_heads if ".self_attn.k_proj." in hf_name else None)
    if heads is None:
        return rows
    return half_to_interleaved(rows.reshape(rows.shape[0], -1), heads).reshape(rows.shape)
