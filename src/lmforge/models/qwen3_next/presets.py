"""Named sizes of Qwen3-Next, from the released config.json, and a test size."""
from __future__ import annotations

from lmforge.config import ConfigError
from lmforge.models.qwen3_5.presets import check_args as check_hybrid_args, every_fourth_full
from lmforge.models.qwen3_next.model import HybridSparseArgs

PRESETS: dict[str, HybridSparseArgs] = {
    # 4 layers (linear x 3, full), 16 experts of width 32 (top-4) and a shared one of 64;
    # layer 1's MLP dense, as wide as 4 experts
    "qwen3-next-debug": HybridSparseArgs(
        dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=259, ffn_dim=128,
        max_seq_len=512, explicit_head_dim=16, qk_norm=True, layer_types=every_fourth_full(4),
        linear_key_heads=2, linear_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, n_experts=16, top_k=4, moe_ffn_dim=32, shared_ffn_dim=64,
        dense_layers=(1,)),
    # Qwen/Qwen3-Next-80B-A3B-Instruct (and -Thinking): 512 experts, top-10, one shared.
    # Checked (no value changed) against a public copy of the Instruct config.json (shrunk
    # to one layer and a tiny vocabulary, every other field as released): hidden 2048,
    # intermediate 5120 (transformers' default, 5632, is not the release's), 16 heads / 2
    # KV, head_dim 256, linear 16 key / 32 value heads of 128, conv kernel 4, 262144
    # positions, rope_theta 1e7, partial_rotary_factor 0.25, rms_norm_eps 1e-6, experts
    # 512 of width 512, top-10, shared 512, norm_topk_prob true, mlp_only_layers [] with
    # decoder_sparse_step 1 (no dense layer), full_attention_interval 4, untied; 48
    # layers and vocab 151936 from THUDM/slime's scripts/models/qwen3-next-80B-A3B.sh
    # (which agrees on the rest) and transformers' Qwen3NextConfig defaults.
    "qwen3-next-80b-a3b": HybridSparseArgs(
        dim=2048, n_layers=48, n_heads=16, n_kv_heads=2, vocab_size=151936, ffn_dim=5120,
        max_seq_len=262144, rope_theta=1e7, norm_eps=1e-6, explicit_head_dim=256,
        qk_norm=True, layer_types=every_fourth_full(48), linear_key_heads=16,
        linear_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        n_experts=512, top_k=10, moe_ffn_dim=512, shared_ffn_dim=512),
}


def check_args(args: HybridSparseArgs) -> None:
    """Qwen3.5's checks (the layer pattern, the heads), and the experts' as ``MoEArgs``
    makes them: a top-k the experts can give, widths, dense layers that exist."""
    check_hybrid_args(args)
    for name in ("moe_ffn_dim", "shared_ffn_dim"):
        if getattr(args, name) < 1:
            raise ConfigError(f"model.{name}: {getattr(args, name)} must be positive")
    try:
        args.moe  # (n_experts, top_k)
    except ValueError as e:
        raise ConfigError(f"model.{e}") from None
    outside = [i for i in args.dense_layers if not 0 <= i < args.n_layers]
    if outside:
        raise ConfigError(f"model.dense_layers: layer {outside[0]} is not one of the "
                          f"{args.n_layers} layers")
