"""gpt-oss as llama.cpp reads it (GGUF architecture ``gpt-oss``): attention with biases
and per-head sinks (``attn_sinks``), sliding and global layers in turn (llama.cpp slides
the even layers, from the first: ``sliding_window``), YaRN as RoPE scaling, a biased
router (``ffn_gate_inp``) and each layer's experts as ``ffn_{gate,up,down}_exps`` with
their biases, gate and up apart (the files interleave them), as llama.cpp's own converter
writes plain (not MXFP4) experts. A released checkpoint's MXFP4 experts are dequantized
first (``hf.checkpoint_in``): they are written in the file type asked for, where the
converter would repack them as MXFP4. Tensor names come from the gguf package's table.

llama.cpp fixes the clamped SwiGLU's alpha (1.702) and limit (7.0) and the layers' kinds:
a model with other values or kinds has no GGUF form here. llama.cpp's YaRN always rounds
its correction band outwards to whole dimensions: a model that does so (``truncate``
true) runs in llama.cpp as in lmforge (equal logits, measured); gpt-oss's own
(``truncate`` false) runs with a few rotary frequencies slightly off (logits within
about 0.07 on a tiny random model), as every llama.cpp gpt-oss file does.
"""
from __future__ import annotations

import re
from typing import Iterator

import torch

from lmforge.models.gpt_oss import hf
from lmforge.models.gpt_oss.model import SLIDING, GptOssArgs
from lmforge.models.mapping import gguf_tensor_name, write_gguf_shape
from lmforge.models.qwen3_moe.gguf import write_expert_counts

SWIGLU = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}  # llama.cpp's gpt-oss, fixed
_EXPERTS = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias)?")


def architecture(args: GptOssArgs) -> str:
    return "gpt-oss"


def unsupported(args: GptOssArgs) -> str:
    """Why this model has no GGUF form ("" when it has one)."""
    for field, value in SWIGLU.items():
        if getattr(args, field) != value:
            return (f"{field} is {getattr(args, field)}, and llama.cpp's gpt-oss computes its "
                    f"experts with {value}")
    alternating = tuple(SLIDING if i % 2 == 0 else "global" for i in range(args.n_layers))
    if tuple(k == SLIDING for k in args.attention_kinds) != tuple(
            k == SLIDING for k in alternating):
        return ("layer_types are not sliding and full attention in turn from the first "
                "layer, the only pattern llama.cpp's gpt-oss runs")
    rope = args.rope_scaling
    if rope is not None and (rope.kind != "yarn" or rope.attention_factor is not None):
        return ("its RoPE scaling is not YaRN with the attention factor from the scale "
                "factor, the only one written to GGUF for gpt-oss")
    return ""


def write_hparams(writer, args: GptOssArgs) -> None:
    """The keys llama.cpp's converter writes for gpt-oss (``feed_forward_length`` and
    ``expert_feed_forward_length``: an expert's width)."""
    write_gguf_shape(writer, args, args.head_dim)
    rope = args.rope_scaling
    if rope is not None:
        writer.add_rope_scaling_type(_gguf().RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope.factor)
        writer.add_rope_scaling_orig_ctx_len(rope.original_max_position_embeddings)
        writer.add_rope_scaling_yarn_beta_fast(rope.beta_fast)
        writer.add_rope_scaling_yarn_beta_slow(rope.beta_slow)
    write_expert_counts(writer, args)
    writer.add_key_length(args.head_dim)
    writer.add_value_length(args.head_dim)
    writer.add_sliding_window(args.sliding_window)
    writer.add_expert_feed_forward_length(args.ffn_dim)


def tensors(hf_sd: dict, args: GptOssArgs, name_map) -> Iterator[tuple[str, torch.Tensor]]:
    """(GGUF name, tensor) of every weight; ``name_map``: the gguf package's
    ``TensorNameMap`` for gpt-oss. The experts come in the MoE block's layout
    (``hf.checkpoint_in``: gate rows then up rows, (experts, out, in))."""
    for name, tensor in hf.checkpoint_in(hf_sd, args, "model.safetensors").items():
        if name == "lm_head.weight" and args.tie_embeddings:
            continue  # llama.cpp reads a missing output as the token embedding
        match = _EXPERTS.fullmatch(name)
        if match is None:
            yield gguf_name(name, name_map), tensor
        elif match[2] == "down_proj":
            yield gguf_name(f"{match[1]}.down_proj.{_kind(match)}", name_map), tensor
        else:  # gate rows, then up rows (weights: dim 1; biases: dim 1 of (experts, 2 ffn))
            gate, up = tensor.chunk(2, dim=1)
            yield gguf_name(f"{match[1]}.gate_proj.{_kind(match)}", name_map), gate
            yield gguf_name(f"{match[1]}.up_proj.{_kind(match)}", name_map), up


def _kind(match: re.Match) -> str:
    return "bias" if match[3] else "weight"


def gguf_name(hf_name: str, name_map) -> str:
    """The GGUF name of a tensor (the sinks as ``attn_sinks.weight``, as the converter
    names them)."""
    if hf_name.endswith(".self_attn.sinks"):
        hf_name += ".weight"
    return gguf_tensor_name(hf_name, name_map)


def rows_as_gguf(hf_name: str, rows: torch.Tensor, args: GptOssArgs) -> torch.Tensor:
    return rows  # llama.cpp's gpt-oss rotates halves, as HF stores the rows


def _gguf():
    import gguf  # optional: only a GGUF export reaches here (export/gguf.py checks it)

    return gguf
