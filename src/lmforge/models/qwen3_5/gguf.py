"""Qwen3.5's language model as llama.cpp reads it (GGUF architecture ``qwen35``), the
tensors transformed as llama.cpp's own converter transforms them:

* every zero-centred RMSNorm weight (the block's two, the final one, q/k norms) is
  written plus one (llama.cpp multiplies by the weight); the Gated DeltaNet's gated norm
  is a plain one and stays as it is;
* A_log becomes A = -exp(A_log) (``ssm_a``: llama.cpp multiplies softplus(a + dt_bias)
  by it), dt_bias is ``ssm_dt.bias``, the depthwise convolution (channels, 1, kernel)
  is squeezed to (channels, kernel);
* where a key head serves several value heads, the value heads go from grouped by key
  head (v0 and v1 of k0, then of k1) to tiled (v0 of every k, then v1 of every k):
  llama.cpp repeats the key heads by tiling them. That reorders the value rows of
  in_proj_qkv and the conv channels, in_proj_z, in_proj_b / in_proj_a, A and dt_bias
  (one per value head), and out_proj's input columns;
* q_proj keeps each head's query then output gate, as stored: llama.cpp splits them so.

Keys: the linear layers' shape as ``ssm.*`` (conv kernel, key head dim as the state
size, key heads as the group count, value heads as the time-step rank, the value width
as the inner size), which layers are linear (``attention.recurrent_layers``, any
pattern; ``full_attention_interval`` beside it is the converter's default, unread), the
rotary dims of a head (``rope.dimension_count``) and the multimodal rotary's sections.
A text token has one position on each of llama.cpp's first three axes and 0 on the
fourth, so sections that send every rotary pair to one of the three rotate as plain
RoPE, as the model does: transformers' default for Qwen3.5 ([11, 11, 10], which the
converter writes) where it fits the head (ggml asks that they sum to at most head_dim:
a head under 32 features does not hold them, and the converter's file aborts there),
else equal thirds.

llama.cpp's qwen35 sizes a value head as a key head (its state is square), and aborts
on a model whose layers are all of one kind (its cache for the other is empty): such
models have no GGUF form here. An image-text directory's language model is written
alone, as the converter writes it (the vision tower goes to llama.cpp's separate
projector file, which lmforge does not write). The convolution's kernel must be stored
in f32 whatever the file type (ggml's ssm_conv reads f32 only), as the converter keeps
it: export/gguf.py's ``F32_MATRICES`` decides that.

llama.cpp's other hybrid architectures read these layers the same way, and their
families' gguf.py use the parts here (``hybrid_unsupported``, ``write_hybrid_hparams``,
``hybrid_tensors``): qwen35moe (Qwen3.5-MoE) as qwen35 with experts; qwen3next
(Qwen3-Next) with its value heads grouped by key head, as stored, and no rope sections.
"""
from __future__ import annotations

from typing import Iterator

import torch

from lmforge.models.mapping import gguf_tensor_name, write_gguf_shape
from lmforge.models.qwen3_5.model import HybridArgs
from lmforge.models.qwen3_5.vision import LANGUAGE_PREFIX, VISION_PREFIX

LLAMA_CPP_PYTHON = "0.3.36"  # the llama.cpp release this form was checked against
# transformers' default mrope_section for Qwen3.5, padded to llama.cpp's four axes
ROPE_SECTIONS = (11, 11, 10, 0)
DEFAULT_FULL_ATTENTION_INTERVAL = 4  # transformers' and the converter's default


def architecture(args: HybridArgs) -> str:
    return "qwen35"


def unsupported(args: HybridArgs) -> str:
    """Why this model has no GGUF form ("" when it has one)."""
    return hybrid_unsupported(args, "qwen35")


def hybrid_unsupported(args: HybridArgs, arch: str) -> str:
    """What llama.cpp's hybrid ``arch`` (qwen35, qwen35moe, qwen3next: the same linear
    layers and cache) cannot run of a Qwen3.5-shaped model ("" when it runs it)."""
    if args.linear_key_head_dim != args.linear_value_head_dim:
        return (f"linear_value_head_dim ({args.linear_value_head_dim}) differs from "
                f"linear_key_head_dim ({args.linear_key_head_dim}), and llama.cpp's {arch} "
                f"(llama-cpp-python {LLAMA_CPP_PYTHON}) sizes value heads as key heads")
    kinds = set(args.layer_types)
    if len(kinds) == 1:
        return (f"layer_types: every layer is {next(iter(kinds))}, and llama.cpp's {arch} "
                f"(llama-cpp-python {LLAMA_CPP_PYTHON}) needs both kinds (it aborts "
                f"allocating the empty cache of the other)")
    return ""


def write_hparams(writer, args: HybridArgs) -> None:
    """The keys llama.cpp's qwen35 reads (the converter's, in its order)."""
    write_hybrid_hparams(writer, args)
    writer.add_rope_dimension_sections(list(rope_sections(args)))


def write_hybrid_hparams(writer, args: HybridArgs) -> None:
    """The keys every hybrid architecture reads: the decoder's shape, the heads' width,
    the linear layers' shape and which layers are linear."""
    write_gguf_shape(writer, args, args.rotary_dim)
    writer.add_key_length(args.head_dim)
    writer.add_value_length(args.head_dim)
    writer.add_ssm_conv_kernel(args.linear_conv_kernel)
    writer.add_ssm_state_size(args.linear_key_head_dim)
    writer.add_ssm_group_count(args.linear_key_heads)
    writer.add_ssm_time_step_rank(args.linear_value_heads)
    writer.add_ssm_inner_size(args.linear_value_head_dim * args.linear_value_heads)
    # (the gguf package's add_recurrent_layers is newer than the pinned one)
    writer.add_array(f"{writer.arch}.attention.recurrent_layers",
                     [args.is_linear(i) for i in range(args.n_layers)])
    # (what the converter writes where config.json has none, as transformers saves it:
    # llama.cpp reads the per-layer list above first, and lmforge keeps only that)
    writer.add_full_attention_interval(DEFAULT_FULL_ATTENTION_INTERVAL)


def rope_sections(args: HybridArgs) -> tuple[int, int, int, int]:
    """llama.cpp's multimodal rotary sections under which a text token rotates as plain
    RoPE: ``ROPE_SECTIONS`` where they do, else a third of the pairs per axis."""
    pairs = args.rotary_dim // 2
    if _rotates_plainly(ROPE_SECTIONS, pairs, args.head_dim):
        return ROPE_SECTIONS
    third = -(-pairs // 3)
    return third, third, third, 0


def _rotates_plainly(sections, pairs: int, head_dim: int) -> bool:
    """Whether ggml's interleaved multimodal rotary (``ggml_mrope_cache_init``) takes every
    pair's angle from the first three axes (a text token's position; the fourth is 0),
    and accepts the sections (their sum at most head_dim)."""
    total = sum(sections)
    if total > head_dim:
        return False
    return all((s % 3 == 0 and s < 3 * sections[0]) or (s % 3 == 1 and s < 3 * sections[1])
               or (s % 3 == 2 and s < 3 * sections[2])
               for s in (pair % total for pair in range(pairs)))


def tensors(hf_sd: dict, args: HybridArgs, name_map) -> Iterator[tuple[str, torch.Tensor]]:
    """(GGUF name, tensor) of every weight of the language model; ``name_map``: the gguf
    package's ``TensorNameMap`` for qwen35."""
    return hybrid_tensors(hf_sd, args, name_map, tiled=True)


def hybrid_tensors(hf_sd: dict, args: HybridArgs, name_map,
                   tiled: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """``tensors`` for any hybrid architecture: ``tiled``, whether it reads the linear
    layers' value heads tiled over the key heads (qwen35, qwen35moe) rather than grouped
    by key head, as stored (qwen3next)."""
    for name, tensor in hf_sd.items():
        if name.startswith(VISION_PREFIX):
            continue  # (the projector file's, not the language model's)
        name = text_name(name)
        if name == "lm_head.weight" and args.tie_embeddings:
            continue  # llama.cpp reads a missing output as the token embedding
        if tiled and ".linear_attn." in name:
            tensor = tiled_value_heads(name, tensor, args)
        tensor = as_gguf(name, tensor)
        if name.endswith(".linear_attn.dt_bias"):  # (the gguf table's name for it)
            name = name.removesuffix("dt_bias") + "dt_proj.bias"
        yield gguf_name(name, name_map), tensor


def as_gguf(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """One tensor (HF name, its heads in the order the architecture reads) as llama.cpp's
    hybrid architectures read it."""
    if ".linear_attn." in name:
        if name.endswith(".A_log"):
            return -torch.exp(tensor.float())
        if name.endswith(".conv1d.weight"):
            return tensor[:, 0]  # (channels, 1, kernel) -> (channels, kernel)
        return tensor
    if name.endswith("norm.weight"):  # zero-centred: x / rms(x) * (1 + weight)
        return tensor.float() + 1.0
    return tensor


def tiled_value_heads(name: str, tensor: torch.Tensor, args: HybridArgs) -> torch.Tensor:
    """A linear layer's tensor with its value heads in the order llama.cpp broadcasts the
    key heads over them (tiled); the same tensor where each key head has one."""
    groups, per_key = args.linear_key_heads, args.linear_value_heads // args.linear_key_heads
    if per_key == 1:
        return tensor
    key_width = 2 * args.linear_key_heads * args.linear_key_head_dim
    width = args.linear_value_head_dim
    if name.endswith((".in_proj_qkv.weight", ".conv1d.weight")):
        return torch.cat([tensor[:key_width],
                          _tile(tensor[key_width:], 0, groups, per_key, width)])
    if name.endswith(".in_proj_z.weight"):
        return _tile(tensor, 0, groups, per_key, width)
    if name.endswith((".in_proj_b.weight", ".in_proj_a.weight", ".A_log", ".dt_bias")):
        return _tile(tensor, 0, groups, per_key, 1)
    if name.endswith(".out_proj.weight"):
        return _tile(tensor, 1, groups, per_key, width)
    return tensor  # (the gated norm: one head's width, shared)


def _tile(tensor: torch.Tensor, dim: int, groups: int, per_key: int, width: int) -> torch.Tensor:
    """Along ``dim``: (group, head in group, width) -> (head in group, group, width)."""
    shape = tensor.shape
    split = tensor.reshape(*shape[:dim], groups, per_key, width, *shape[dim + 1:])
    return split.transpose(dim, dim + 1).reshape(shape)


def text_name(hf_name: str) -> str:
    """A text-only checkpoint's name of a tensor (an image-text one's language model is
    under ``model.language_model.``), as the gguf package's table knows it."""
    if hf_name.startswith(LANGUAGE_PREFIX):
        return "model." + hf_name.removeprefix(LANGUAGE_PREFIX)
    return hf_name


def gguf_name(hf_name: str, name_map) -> str:
    """(what export/gguf.py asks a family for: a LoRA adapter's module)"""
    return gguf_tensor_name(text_name(hf_name), name_map)


def rows_as_gguf(hf_name: str, rows: torch.Tensor, args: HybridArgs) -> torch.Tensor:
    """A LoRA adapter's B (output rows) in llama.cpp's qwen35 order (``tiled_rows``)."""
    return tiled_rows(hf_name, rows, args, "qwen35")


def tiled_rows(hf_name: str, rows: torch.Tensor, args: HybridArgs, arch: str) -> torch.Tensor:
    """A LoRA adapter's B (output rows) in the order of ``arch``, which tiles value heads:
    a linear layer's input projections' value-head rows tiled, as their weights' are.
    out_proj's value heads are its input columns, a LoRA A's, which this hook never sees:
    where a key head serves several value heads, an out_proj adapter is refused (a
    ValueError, reported in one line) rather than written misplaced."""
    if ".linear_attn.out_proj." in hf_name and args.linear_value_heads > args.linear_key_heads:
        raise ValueError(
            f"{hf_name}: no GGUF form of a LoRA adapter on out_proj: llama.cpp's {arch} "
            f"(llama-cpp-python {LLAMA_CPP_PYTHON}) reads the value heads tiled over the "
            f"{args.linear_key_heads} key heads, which reorders the adapter's A columns; "
            f"leave out_proj out of lora.targets, or merge the adapter (--format gguf)")
    if ".linear_attn.in_proj_" not in hf_name:
        return rows
    return tiled_value_heads(hf_name, rows, args)
