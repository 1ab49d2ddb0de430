"""DeepSeek-V3 (and Moonlight) as llama.cpp reads it (GGUF architecture ``deepseek2``).

Multi-head latent attention runs in llama.cpp as one shared latent key and value
(``head_count_kv`` 1, ``key_length`` kv_lora_rank + qk_rope_head_dim, ``value_length``
kv_lora_rank; the per-head sizes as ``key_length_mla`` / ``value_length_mla``), with
``kv_b_proj`` split per head into ``attn_k_b`` (transposed: latent x nope) and ``attn_v_b``,
as llama.cpp's own converter splits it. The router scores by a sigmoid
(``expert_gating_func``), picks experts in ``expert_group_used_count`` of
``expert_group_count`` groups, steers the choice by the correction bias (``exp_probs_b``),
scales by ``routed_scaling_factor`` and renormalises where ``norm_topk_prob`` says; each
MoE layer's experts are stacked into ``ffn_{gate,up,down}_exps``, its shared experts are
``ffn_*_shexp``, and the first ``first_k_dense_replace`` layers keep their dense MLP
(``leading_dense_block_count``). The multi-token-prediction layers a released checkpoint
holds after the last are left out, as the model and the converter leave them.
llama.cpp's latent norms use the file's ``rms_norm_eps`` where the model's use 1e-6
(``models/mla.py``): equal for DeepSeek-V3's and Moonlight's configs.

q and k's rotary features are written as stored: DeepSeek's checkpoints pair them
(0, 1), (2, 3).. (``rope_interleave``), as llama.cpp's deepseek2 rotates; a model that
rotates halves is refused, as is YaRN RoPE scaling, whose keys are not verified against
llama.cpp here, and a model without a query latent (Moonlight): llama.cpp 0.3.36 reads one
only at DeepSeek-V2-Lite's depths, where it also reads none from a model that has one.
"""
from __future__ import annotations

import re
from typing import Iterator

import torch

from lmforge.models.deepseek_v3.model import DeepseekV3Args
from lmforge.models.mapping import gguf_tensor_name
from lmforge.models.qwen3_moe.gguf import with_experts_stacked, write_expert_counts

_LAYER = re.compile(r"model\.layers\.(\d+)\.")
LITE_DEPTHS = (26, 27)  # llama.cpp's deepseek2 reads no q_lora_rank at these depths


def architecture(args: DeepseekV3Args) -> str:
    return "deepseek2"


def unsupported(args: DeepseekV3Args) -> str:
    """Why this model has no GGUF form ("" when it has one)."""
    if not args.rope_interleave:
        return ("rope_interleave is false (rotary features rotating halves), and llama.cpp's "
                "deepseek2 rotates adjacent pairs: not reordered for GGUF yet")
    if args.rope_scaling is not None:
        return "its YaRN RoPE scaling is not written to GGUF for DeepSeek-V3 yet"
    depths = " or ".join(map(str, LITE_DEPTHS))
    if args.q_lora_rank is None:  # (measured there: the tokens part from ours within a few)
        return (f"q_lora_rank is null (a plain q_proj): llama.cpp 0.3.36's deepseek2 reads "
                f"one only at DeepSeek-V2-Lite's depth ({depths} layers), and there its "
                f"greedy tokens were not found equal to ours")
    if args.n_layers in LITE_DEPTHS:
        return (f"{args.n_layers} layers is DeepSeek-V2-Lite's depth, at which llama.cpp "
                f"0.3.36's deepseek2 reads no query latent, where this model has one "
                f"(q_lora_rank {args.q_lora_rank})")
    return ""


def write_hparams(writer, args: DeepseekV3Args) -> None:
    """The keys llama.cpp's converter writes for deepseek2, and the gating function,
    which llama.cpp otherwise takes for DeepSeek-V2's softmax."""
    writer.add_context_length(args.max_seq_len)
    writer.add_embedding_length(args.dim)
    writer.add_block_count(args.n_layers)
    writer.add_feed_forward_length(args.ffn_dim)
    writer.add_head_count(args.n_heads)
    writer.add_head_count_kv(1)  # the shared latent (MLA as MQA)
    writer.add_rope_freq_base(args.rope_theta)
    writer.add_layer_norm_rms_eps(args.norm_eps)
    write_expert_counts(writer, args)
    writer.add_expert_group_count(args.n_groups)
    writer.add_expert_group_used_count(args.topk_groups)
    writer.add_expert_gating_func(_gguf().ExpertGatingFuncType.SIGMOID)
    writer.add_leading_dense_block_count(args.first_k_dense)
    writer.add_vocab_size(args.vocab_size)
    if args.q_lora_rank is not None:
        writer.add_q_lora_rank(args.q_lora_rank)
    writer.add_kv_lora_rank(args.kv_lora_rank)
    writer.add_key_length(args.kv_lora_rank + args.qk_rope_head_dim)
    writer.add_value_length(args.kv_lora_rank)
    writer.add_key_length_mla(args.qk_nope_head_dim + args.qk_rope_head_dim)
    writer.add_value_length_mla(args.v_head_dim)
    writer.add_expert_feed_forward_length(args.moe_ffn_dim)
    writer.add_expert_shared_count(args.n_shared_experts)
    writer.add_expert_weights_scale(args.routed_scaling_factor)
    if args.norm_topk_prob:
        writer.add_expert_weights_norm(True)
    writer.add_rope_dimension_count(args.qk_rope_head_dim)


def tensors(hf_sd: dict, args: DeepseekV3Args,
            name_map) -> Iterator[tuple[str, torch.Tensor]]:
    """(GGUF name, tensor) of every weight; ``name_map``: the gguf package's
    ``TensorNameMap`` for deepseek2."""
    for name, tensor in with_experts_stacked(hf_sd):
        layer = _LAYER.match(name)
        if layer is not None and int(layer[1]) >= args.n_layers:
            continue  # a multi-token-prediction layer
        if name == "lm_head.weight" and args.tie_embeddings:
            continue  # llama.cpp reads a missing output as the token embedding
        if name.endswith(".self_attn.kv_b_proj.weight"):
            yield from _split_kv_b(name, tensor, args, name_map)
        else:
            yield gguf_name(name, name_map), tensor


def _split_kv_b(name: str, kv_b: torch.Tensor, args: DeepseekV3Args, name_map):
    """``kv_b_proj`` (heads x (nope + v), latent) as llama.cpp's ``attn_k_b`` (heads,
    latent, nope) and ``attn_v_b`` (heads, v, latent)."""
    nope, v = args.qk_nope_head_dim, args.v_head_dim
    per_head = kv_b.reshape(args.n_heads, nope + v, kv_b.shape[-1])
    k_b, v_b = per_head.split([nope, v], dim=1)
    yield (gguf_name(name.replace("kv_b_proj", "k_b_proj"), name_map),
           k_b.transpose(1, 2).contiguous())
    yield gguf_name(name.replace("kv_b_proj", "v_b_proj"), name_map), v_b.contiguous()


def gguf_name(hf_name: str, name_map) -> str:
    """The GGUF name of a tensor; ``kv_b_proj`` has none (the file holds it split), so a
    LoRA adapter on it is refused here."""
    if ".self_attn.kv_b_proj." in hf_name:
        raise ValueError(f"{hf_name}: llama.cpp's deepseek2 holds kv_b_proj split in "
                         f"attn_k_b and attn_v_b; an adapter on it has no GGUF form")
    # the correction bias, as the gguf package's table names it: exp_probs_b.bias
    hf_name = re.sub(r"e_score_correction_bias$", "e_score_correction.bias", hf_name)
    return gguf_tensor_name(hf_name, name_map)


def rows_as_gguf(hf_name: str, rows: torch.Tensor, args: DeepseekV3Args) -> torch.Tensor:
    return rows  # the rotary features pair as llama.cpp's deepseek2 rotates (see above)


def _gguf():
    import gguf  # optional: only a GGUF export reaches here (export/gguf.py checks it)

    return gguf
