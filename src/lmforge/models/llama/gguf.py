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

# HF model_type -> llama.cpp architecture name
ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def architecture(args: LlamaArgs) -> str:
    return ARCHITECTURES[args.family]


def write_hparams(writer, args: LlamaArgs) -> None:
    """The shape keys llama.cpp reads for this architecture."""
    writer.add_context_length(args.max_seq_len)
    writer.add_embedding_length(args.dim)
    writer.add_block_count(args.n_layers)
    writer.add_feed_forward_length(args.ffn_dim)
    writer.add_head_count(args.n_heads)
    writer.add_head_count_kv(args.n_kv_heads)
    writer.add_rope_freq_base(args.rope_theta)
    writer.add_layer_norm_rms_eps(args.norm_eps)
    writer.add_rope_dimension_count(args.head_dim)
    if args.head_dim != args.dim // args.n_heads:  # Qwen3: heads sized apart from dim
        writer.add_key_length(args.head_dim)
        writer.add_value_length(args.head_dim)


def tensors(hf_sd: dict, args: LlamaArgs, name_map) -> Iterator[tuple[str, torch.Tensor]]:
    """(GGUF name, tensor) of every weight; ``name_map``: the gguf package's
    ``TensorNameMap`` for this architecture."""
    interleave = architecture(args) == "llama"
    for name, tensor in hf_sd.items():
        if name == "lm_head.weight" and args.tie_embeddings:
            continue  # llama.cpp reads a missing output as the token embedding
        if interleave and name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
            heads = args.n_heads if "q_proj" in name else args.n_kv_heads
            tensor = half_to_interleaved(tensor, heads)
        gguf_name = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(f"{name}: no GGUF name for it in the gguf package's table")
        yield gguf_name, tensor
    if args.rope_scaling is not None:  # Llama 3.1: the divisor of each rotary frequency
        plain = LlamaArgs(**{**args.__dict__, "rope_scaling": None})
        yield "rope_freqs.weight", (rope_frequencies(plain) / rope_frequencies(args)).float()
