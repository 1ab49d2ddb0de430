"""Qwen3.5-MoE's language model as llama.cpp reads it (GGUF architecture ``qwen35moe``):
Qwen3.5's form (``models/qwen3_5/gguf.py``: the same transforms, value heads tiled, rope
sections and refusals) with the experts' keys and tensors as Qwen3-Next writes them
(``models/qwen3_next/gguf.py``: each layer's experts stacked, the gated shared expert),
as llama.cpp's own converter writes them. An image-text directory's language model is
written alone, as the converter writes it, and the multi-token-prediction layers the
released checkpoints hold are left out, as lmforge leaves them out on load.
"""
from __future__ import annotations

from typing import Iterator

import torch

from lmforge.models.qwen3_5 import gguf as qwen3_5_gguf
from lmforge.models.qwen3_next import gguf as qwen3_next_gguf
from lmforge.models.qwen3_next.model import HybridSparseArgs

ARCH = "qwen35moe"


def architecture(args: HybridSparseArgs) -> str:
    return ARCH


def unsupported(args: HybridSparseArgs) -> str:
    """Why this model has no GGUF form ("" when it has one; Qwen3.5-MoE's config has no
    dense layers and always rescales the chosen experts' weights, as llama.cpp does)."""
    return qwen3_5_gguf.hybrid_unsupported(args, ARCH)


def write_hparams(writer, args: HybridSparseArgs) -> None:
    """Qwen3.5's keys and the experts' (``feed_forward_length``: an expert's width, the
    model's only one; llama.cpp reads the expert keys)."""
    qwen3_5_gguf.write_hybrid_hparams(writer, args)
    qwen3_next_gguf.write_expert_hparams(writer, args)
    writer.add_rope_dimension_sections(list(qwen3_5_gguf.rope_sections(args)))


def tensors(hf_sd: dict, args: HybridSparseArgs, name_map) -> Iterator[tuple[str, torch.Tensor]]:
    """(GGUF name, tensor) of every weight; ``name_map``: the gguf package's
    ``TensorNameMap`` for qwen35moe."""
    return qwen3_5_gguf.hybrid_tensors(qwen3_next_gguf.language_model(hf_sd), args, name_map,
                                       tiled=True)


gguf_name = qwen3_5_gguf.gguf_name  # (what export/gguf.py asks a family for)


def rows_as_gguf(hf_name: str, rows: torch.Tensor, args: HybridSparseArgs) -> torch.Tensor:
    return qwen3_5_gguf.tiled_rows(hf_name, rows, args, ARCH)
