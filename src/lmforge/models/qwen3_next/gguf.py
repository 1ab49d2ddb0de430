"""Qwen3-Next as llama.cpp reads it (GGUF architecture ``qwen3next``), the tensors
transformed as llama.cpp's own converter transforms them: Qwen3.5's hybrid layers
(``models/qwen3_5/gguf.py``: norms plus one, A as -exp(A_log), the convolution squeezed,
the same keys but the rope sections: qwen3next rotates plain RoPE) with Qwen3-MoE's
experts stacked per layer (``models/qwen3_moe/gguf.py``) and the gated shared expert
under the gguf package's own names.

What differs from Qwen3.5's form is the linear layers' input projection, which the
checkpoint fuses per key head ([q, k, v, z] of key head 0, then of key head 1...):
llama.cpp reads it as two tensors, q, k and v (``attn_qkv``, the convolution's channel
order) and z (``attn_gate``), as the converter splits it. qwen3next repeats each key
head over its value heads in place (the checkpoint's order), so no value head moves;
in_proj_ba stays fused (``ssm_ba``: [b, a] per key head, as llama.cpp splits it). The
multi-token-prediction layers the released checkpoints hold are left out, as lmforge
leaves them out on load (the converter's --no-mtp).

llama.cpp's qwen3next puts experts in every layer and always rescales the chosen
experts' weights to sum to 1, sizes a value head as a key head and needs layers of both
kinds: other models are refused.
"""
from __future__ import annotations

from typing import Iterator

import torch

from lmforge.models.mapping import gguf_tensor_name
from lmforge.models.qwen3_5 import gguf as qwen3_5_gguf
from lmforge.models.qwen3_5.gguf import LLAMA_CPP_PYTHON
from lmforge.models.qwen3_5.vision import VISION_PREFIX
from lmforge.models.qwen3_moe import gguf as qwen3_moe_gguf
from lmforge.models.qwen3_next.hf import MTP_PREFIX  # (dropped on load too)
from lmforge.models.qwen3_next.model import HybridSparseArgs

ARCH = "qwen3next"


def architecture(args: HybridSparseArgs) -> str:
    return ARCH


def unsupported(args: HybridSparseArgs) -> str:
    """Why this model has no GGUF form ("" when it has one)."""
    moe = qwen3_moe_gguf.moe_unsupported(args, ARCH)
    if moe:
        return f"{moe} (llama-cpp-python {LLAMA_CPP_PYTHON})"
    return qwen3_5_gguf.hybrid_unsupported(args, ARCH)


def write_hparams(writer, args: HybridSparseArgs) -> None:
    """The keys llama.cpp's qwen3next reads: Qwen3.5's but the rope sections, and the
    experts' (``feed_forward_length``: the dense width config.json gives, as the
    converter writes it)."""
    qwen3_5_gguf.write_hybrid_hparams(writer, args)
    write_expert_hparams(writer, args)


def write_expert_hparams(writer, args: HybridSparseArgs) -> None:
    """The routed experts' count, choice and width, and the shared expert's width."""
    qwen3_moe_gguf.write_expert_counts(writer, args)
    writer.add_expert_feed_forward_length(args.moe_ffn_dim)
    writer.add_expert_shared_feed_forward_length(args.shared_ffn_dim)


def tensors(hf_sd: dict, args: HybridSparseArgs, name_map) -> Iterator[tuple[str, torch.Tensor]]:
    """(GGUF name, tensor) of every weight; ``name_map``: the gguf package's
    ``TensorNameMap`` for qwen3next."""
    split = {}
    for name, tensor in language_model(hf_sd).items():
        if name.endswith(".linear_attn.in_proj_qkvz.weight"):
            prefix = name.removesuffix("qkvz.weight")
            split[f"{prefix}qkv.weight"], split[f"{prefix}z.weight"] = split_qkvz(tensor, args)
        else:
            split[name] = tensor
    return qwen3_5_gguf.hybrid_tensors(split, args, name_map, tiled=False)


def language_model(hf_sd: dict) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors of the model lmforge builds, under text-only names, each
    layer's experts stacked: without the multi-token-prediction layers (as the
    converter's --no-mtp) or an image-text checkpoint's vision tower."""
    kept = {qwen3_5_gguf.text_name(name): tensor for name, tensor in hf_sd.items()
            if not name.startswith((MTP_PREFIX, VISION_PREFIX))}
    return dict(qwen3_moe_gguf.with_experts_stacked(kept))


def split_qkvz(tensor: torch.Tensor, args: HybridSparseArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """A checkpoint's in_proj_qkvz ([q, k, v, z] per key head) as Qwen3.5's in_proj_qkv
    (every key head's q, then k, then v) and in_proj_z, each value head staying with its
    key head."""
    key, value = args.linear_key_head_dim, args.linear_value_head_dim
    per_key = args.linear_value_heads // args.linear_key_heads
    heads = tensor.reshape(args.linear_key_heads, -1, tensor.shape[-1])
    q, k, v, z = heads.split([key, key, per_key * value, per_key * value], dim=1)
    flat = [part.reshape(-1, tensor.shape[-1]) for part in (q, k, v, z)]
    return torch.cat(flat[:3]), flat[3]


gguf_name = gguf_tensor_name  # (what export/gguf.py asks a family for)


def rows_as_gguf(hf_name: str, rows: torch.Tensor, args: HybridSparseArgs) -> torch.Tensor:
    """A LoRA adapter's B (output rows), in the checkpoint's order as qwen3next reads
    every head. An adapter on the fused in_proj_qkvz is refused (a ValueError, reported in
    one line): llama.cpp reads that weight as two tensors, and one adapter cannot be
    written on both."""
    if ".linear_attn.in_proj_qkvz." in hf_name:
        raise ValueError(
            f"{hf_name}: no GGUF form of a LoRA adapter on in_proj_qkvz: llama.cpp's {ARCH} "
            f"(llama-cpp-python {LLAMA_CPP_PYTHON}) reads it as two tensors (attn_qkv, "
            f"attn_gate); merge the adapter instead (--format gguf)")
    return rows
