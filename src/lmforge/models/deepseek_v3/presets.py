"""Named sizes of DeepSeek-V3 and Moonlight, from the released config.json files, and a
test size."""
from __future__ import annotations

import re

from lmforge.config import ConfigError
from lmforge.models.deepseek_v3.model import DeepseekV3Args
from lmforge.models.mla import YarnScaling

_MLA = dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)

PRESETS: dict[str, DeepseekV3Args] = {
    # 16 experts of width 32 in 4 groups (2 open), top-4, a shared expert; layer 0 dense
    "deepseek-v3-debug": DeepseekV3Args(
        dim=64, n_layers=3, n_heads=4, n_kv_heads=4, vocab_size=259, ffn_dim=128,
        max_seq_len=512, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=16, n_experts=16, top_k=4, moe_ffn_dim=32,
        n_shared_experts=1, n_groups=4, topk_groups=2, first_k_dense=1),
    # deepseek-ai/DeepSeek-V3 (and R1, V3-0324: the same shapes), without its MTP layer
    "deepseek-v3": DeepseekV3Args(
        dim=7168, n_layers=61, n_heads=128, n_kv_heads=128, vocab_size=129280,
        ffn_dim=18432, max_seq_len=163840, rope_theta=10000.0, norm_eps=1e-6,
        rope_scaling=YarnScaling(factor=40.0, original_max_position_embeddings=4096,
                                 beta_fast=32.0, beta_slow=1.0, mscale=1.0,
                                 mscale_all_dim=1.0),
        q_lora_rank=1536, **_MLA, n_experts=256, top_k=8, moe_ffn_dim=2048,
        n_shared_experts=1, n_groups=8, topk_groups=4, routed_scaling_factor=2.5,
        first_k_dense=3, mtp_layers=1),
    # moonshotai/Moonlight-16B-A3B: no query latent, 64 experts in one group
    "moonlight-16b-a3b": DeepseekV3Args(
        dim=2048, n_layers=27, n_heads=16, n_kv_heads=16, vocab_size=163840,
        ffn_dim=11264, max_seq_len=8192, rope_theta=50000.0, norm_eps=1e-5,
        q_lora_rank=None, **_MLA, n_experts=64, top_k=6, moe_ffn_dim=1408,
        n_shared_experts=2, n_groups=1, topk_groups=1, routed_scaling_factor=2.446,
        first_k_dense=1, mtp_layers=0),
}

_OUR_NAMES = {"ffn_dim": "moe_ffn_dim"}  # MoEArgs' field -> ours, where they differ


def check_args(args: DeepseekV3Args) -> None:
    """What only DeepSeek-V3 refuses: a key per query head, an even rotary slice, dense
    layers that exist, and the experts as the MoE block checks them."""
    if args.n_kv_heads != args.n_heads:
        raise ConfigError(f"model.n_kv_heads: {args.n_kv_heads} must equal n_heads "
                          f"({args.n_heads}): latent attention gives every head its own key")
    if args.qk_rope_head_dim % 2:
        raise ConfigError(f"model.qk_rope_head_dim: {args.qk_rope_head_dim} must be even "
                          f"for RoPE")
    if not 0 <= args.first_k_dense <= args.n_layers:
        raise ConfigError(f"model.first_k_dense: {args.first_k_dense} is not between 0 and "
                          f"the {args.n_layers} layers")
    try:
        args.moe
    except ValueError as e:
        message = str(e)
        for theirs, ours in _OUR_NAMES.items():
            message = re.sub(rf"\b{theirs}\b", ours, message)
        raise ConfigError(f"model.{message}") from None
