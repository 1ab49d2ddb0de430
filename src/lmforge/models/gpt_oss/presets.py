"""Named sizes of gpt-oss, from the released config.json files (openai/gpt-oss-20b and
-120b: 20.9B and 116.8B parameters as transformers holds them), and a test size."""
from __future__ import annotations

from lmforge.config import ConfigError
from lmforge.models.gpt_oss.model import GptOssArgs
from lmforge.models.llama.model import RopeScaling

__all__ = ["PRESETS", "check_args"]

# YaRN: 32 times the 4096 positions of pretraining, the band not rounded to whole dims
_YARN = RopeScaling(factor=32.0, original_max_position_embeddings=4096, kind="yarn",
                    beta_fast=32.0, beta_slow=1.0, truncate=False)
_RELEASED = dict(dim=2880, n_heads=64, n_kv_heads=8, vocab_size=201088, ffn_dim=2880,
                 explicit_head_dim=64, max_seq_len=131072, rope_theta=150000.0,
                 rope_scaling=_YARN, top_k=4, sliding_window=128, swiglu_limit=7.0)

PRESETS: dict[str, GptOssArgs] = {
    "gpt-oss-20b": GptOssArgs(n_layers=24, n_experts=32, **_RELEASED),
    "gpt-oss-120b": GptOssArgs(n_layers=36, n_experts=128, **_RELEASED),
    # 8 experts of width 64, top-2; a window of 8 keys, shorter than test rows
    "gpt-oss-debug": GptOssArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=259,
                                ffn_dim=64, explicit_head_dim=16, max_seq_len=512,
                                rope_scaling=_YARN, n_experts=8, top_k=2, sliding_window=8),
}


def check_args(args: GptOssArgs) -> None:
    """What a gpt-oss model refuses (the shared rules: ``models/presets.py``)."""
    if args.head_dim % 2:
        raise ConfigError(f"model.head_dim: {args.head_dim} must be even for RoPE")
    if not 1 <= args.top_k <= args.n_experts:
        raise ConfigError(f"model.top_k: {args.top_k} must be between 1 and the "
                          f"{args.n_experts} experts (model.n_experts)")
    if args.layer_types is not None and len(args.layer_types) != args.n_layers:
        raise ConfigError(f"model.n_layers: {args.n_layers} layers, but the model's "
                          f"layer_types lists {len(args.layer_types)}")
    if args.sliding_window < 1:
        raise ConfigError(f"model.sliding_window: {args.sliding_window} must be positive")
