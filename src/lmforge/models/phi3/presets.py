"""Named sizes of Phi-3 and Phi-4-mini, with the shapes of the released config.json.

The released 128k models carry LongRoPE factor lists (48 short and 48 long) tuned by
Microsoft; the presets hold the shape only, with every factor 1.0, so an estimate, a
layout plan or training from scratch is right, while fine-tuning a released model reads
its own factors from its directory (``model.init_from``)."""
from __future__ import annotations

import math

from lmforge.config import ConfigError
from lmforge.models.phi3.model import LongRope, Phi3Args

__all__ = ["PRESETS", "check_args"]


def _shape_only_long_rope(rotary_dim: int, max_seq_len: int, original: int) -> LongRope:
    factor = max_seq_len / original
    return LongRope(short_factor=(1.0,) * (rotary_dim // 2), long_factor=(1.0,) * (rotary_dim // 2),
                    original_max_position_embeddings=original,
                    attention_factor=math.sqrt(1 + math.log(factor) / math.log(original)))


_MINI = dict(dim=3072, n_layers=32, n_heads=32, n_kv_heads=32, vocab_size=32064, ffn_dim=8192)

PRESETS: dict[str, Phi3Args] = {
    "phi3-mini-4k": Phi3Args(**_MINI, max_seq_len=4096, sliding_window=2047),
    "phi3-mini-128k": Phi3Args(**_MINI, max_seq_len=131072, sliding_window=262144,
                               rope_scaling=_shape_only_long_rope(96, 131072, 4096)),
    "phi4-mini": Phi3Args(dim=3072, n_layers=32, n_heads=24, n_kv_heads=8, vocab_size=200064,
                          ffn_dim=8192, max_seq_len=131072, partial_rotary_factor=0.75,
                          tie_embeddings=True, sliding_window=262144,
                          rope_scaling=_shape_only_long_rope(96, 131072, 4096)),
}


def check_args(args: Phi3Args) -> None:
    """What a Phi-3 model refuses (the shared rules: ``models/presets.py``)."""
    if args.dim % args.n_heads:
        raise ConfigError(f"model.n_heads: dim ({args.dim}) must be divisible by n_heads "
                          f"({args.n_heads}); Phi-3 has no separate head_dim")
    if args.rotary_dim % 2 or args.rotary_dim > args.head_dim:
        raise ConfigError(f"model.partial_rotary_factor: rotates {args.rotary_dim} features; "
                          f"must be even and at most head_dim ({args.head_dim})")
