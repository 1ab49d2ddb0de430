"""Named sizes of Qwen3-MoE, from the released config.json files, and a test size."""
from __future__ import annotations

from lmforge.config import ConfigError
from lmforge.models.llama.presets import check_args as check_llama_args
from lmforge.models.qwen3_moe.model import SparseArgs

_QWEN3 = dict(max_seq_len=40960, rope_theta=1e6, norm_eps=1e-6, explicit_head_dim=128,
              qk_norm=True, n_experts=128, top_k=8, norm_topk_prob=True, vocab_size=151936)

PRESETS: dict[str, SparseArgs] = {
    # 16 experts of width 64, top-4; the dense layer 0 is as wide as 4 experts
    "qwen3-moe-debug": SparseArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                  vocab_size=259, ffn_dim=256, max_seq_len=512,
                                  qk_norm=True, n_experts=16, top_k=4, moe_ffn_dim=64,
                                  dense_layers=(0,)),
    "qwen3-30b-a3b": SparseArgs(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4,
                                ffn_dim=6144, moe_ffn_dim=768, **_QWEN3),
    "qwen3-235b-a22b": SparseArgs(dim=4096, n_layers=94, n_heads=64, n_kv_heads=4,
                                  ffn_dim=12288, moe_ffn_dim=1536, **_QWEN3),
}


def check_args(args: SparseArgs) -> None:
    """Llama's checks, and the experts': a top-k the experts can give, a width, layers
    that exist."""
    check_llama_args(args)
    if args.n_experts < 1:
        raise ConfigError(f"model.n_experts: {args.n_experts} must be at least 1")
    if not 1 <= args.top_k <= args.n_experts:
        raise ConfigError(f"model.top_k: {args.top_k} must be between 1 and the "
                          f"{args.n_experts} experts (model.n_experts): a token cannot "
                          f"choose more experts than there are")
    if args.moe_ffn_dim < 1:
        raise ConfigError(f"model.moe_ffn_dim: {args.moe_ffn_dim} must be positive")
    outside = [i for i in args.dense_layers if not 0 <= i < args.n_layers]
    if outside:
        raise ConfigError(f"model.dense_layers: layer {outside[0]} is not one of the "
                          f"{args.n_layers} layers")
