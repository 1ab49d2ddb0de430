"""Named sizes of Qwen3.5's language models, from the released config.json files
(``text_config``), and a test size.

Where each value was checked (the Hub's config.json itself could not be read from here;
every field below agrees across the sources named, none was changed):
- shared by both (``_QWEN3_5``, and 256-wide heads, every fourth layer full, untied
  embeddings): vocab_size 248320, rope_theta 1e7 (``rope_parameters``),
  partial_rotary_factor 0.25, rms_norm_eps 1e-6, head_dim 256, linear_conv_kernel_dim 4,
  linear_key/value_head_dim 128, full_attention_interval 4, tie_word_embeddings false:
  the Megatron recipes that convert these checkpoints (radixark/miles and THUDM/slime,
  scripts/models/qwen3.5-{9B,27B}.sh: --vocab-size, --rotary-base, --rotary-percent,
  --norm-epsilon, --kv-channels, --untie-embeddings-and-output-weights, which their 4B
  recipe, a tied model, leaves out); max_position_embeddings 262144: the model cards
  ("262,144 natively") and copies of the 27B's text_config in public code.
- qwen3.5-9b: hidden 4096, 32 layers, 16 heads / 4 KV, intermediate 12288 (miles'
  qwen3.5-9B.sh); 16 key / 32 value linear heads (the model card: "32 for V and 16 for
  QK"; transformers 5.24's Qwen3_5TextConfig defaults, which are this shape).
- qwen3.5-27b: hidden 5120, 64 layers, 24 heads / 4 KV, intermediate 17408 (miles' and
  slime's qwen3.5-27B.sh); 16 key / 48 value linear heads (text_config copies of
  Qwen/Qwen3.5-27B in public code, which agree on every field above).
"""
from __future__ import annotations

from lmforge.config import ConfigError
from lmforge.models.qwen3_5.model import FULL, LAYER_TYPES, LINEAR, HybridArgs


def every_fourth_full(n_layers: int) -> tuple[str, ...]:
    """The released pattern: three linear-attention layers, then one full."""
    return tuple(FULL if (i + 1) % 4 == 0 else LINEAR for i in range(n_layers))


_QWEN3_5 = dict(vocab_size=248320, max_seq_len=262144, rope_theta=1e7, norm_eps=1e-6,
                qk_norm=True, partial_rotary_factor=0.25, linear_conv_kernel=4,
                linear_key_head_dim=128, linear_value_head_dim=128)

PRESETS: dict[str, HybridArgs] = {
    # 4 layers (linear, linear, linear, full), 2 key and 4 value heads in the linear ones
    "qwen3.5-debug": HybridArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2,
                                vocab_size=259, ffn_dim=128, max_seq_len=512,
                                explicit_head_dim=16, qk_norm=True,
                                layer_types=every_fourth_full(4), linear_key_heads=2,
                                linear_value_heads=4, linear_key_head_dim=16,
                                linear_value_head_dim=16),
    "qwen3.5-9b": HybridArgs(dim=4096, n_layers=32, n_heads=16, n_kv_heads=4,
                             ffn_dim=12288, explicit_head_dim=256,
                             layer_types=every_fourth_full(32), linear_key_heads=16,
                             linear_value_heads=32, **_QWEN3_5),
    "qwen3.5-27b": HybridArgs(dim=5120, n_layers=64, n_heads=24, n_kv_heads=4,
                              ffn_dim=17408, explicit_head_dim=256,
                              layer_types=every_fourth_full(64), linear_key_heads=16,
                              linear_value_heads=48, **_QWEN3_5),
}


def check_args(args: HybridArgs) -> None:
    """A pattern with one entry per layer, of the two kinds; heads a layer can split."""
    if len(args.layer_types) != args.n_layers:
        raise ConfigError(f"model.layer_types: {len(args.layer_types)} entries for "
                          f"{args.n_layers} layers (model.n_layers); one per layer")
    bad = [t for t in args.layer_types if t not in LAYER_TYPES]
    if bad:
        raise ConfigError(f"model.layer_types: {bad[0]!r} is not one of "
                          f"{', '.join(LAYER_TYPES)}")
    if args.n_heads % args.n_kv_heads:
        raise ConfigError(f"model.n_kv_heads: {args.n_kv_heads} does not divide model.n_heads "
                          f"({args.n_heads})")
    if args.linear_value_heads % args.linear_key_heads:
        raise ConfigError(f"model.linear_value_heads: {args.linear_value_heads} is not a "
                          f"multiple of model.linear_key_heads ({args.linear_key_heads}): "
                          f"each key head serves a group of value heads")
    if args.rotary_dim % 2 or args.rotary_dim < 2 or args.partial_rotary_factor > 1:
        raise ConfigError(f"model.partial_rotary_factor: {args.partial_rotary_factor} of "
                          f"head_dim {args.head_dim} leaves {args.rotary_dim} rotating "
                          f"features; RoPE needs an even number, at least 2, at most "
                          f"head_dim")
