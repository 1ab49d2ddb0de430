"""Named sizes of Gemma 3 (the text model of each), with the released config.json's
shapes; the 4B/12B/27B's global layers stretch RoPE 8 times (linear)."""
from __future__ import annotations

from lmforge.config import ConfigError
from lmforge.models.gemma3.model import Gemma3Args

__all__ = ["PRESETS", "check_args"]

_LARGE = dict(vocab_size=262208, max_seq_len=131072, sliding_window=1024,
              rope_linear_factor=8.0)

PRESETS: dict[str, Gemma3Args] = {
    "gemma3-1b": Gemma3Args(dim=1152, n_layers=26, n_heads=4, n_kv_heads=1, vocab_size=262144,
                            ffn_dim=6912, explicit_head_dim=256, max_seq_len=32768,
                            sliding_window=512),
    "gemma3-4b": Gemma3Args(dim=2560, n_layers=34, n_heads=8, n_kv_heads=4, ffn_dim=10240,
                            explicit_head_dim=256, **_LARGE),
    "gemma3-12b": Gemma3Args(dim=3840, n_layers=48, n_heads=16, n_kv_heads=8, ffn_dim=15360,
                             explicit_head_dim=256, **_LARGE),
    "gemma3-27b": Gemma3Args(dim=5376, n_layers=62, n_heads=32, n_kv_heads=16, ffn_dim=21504,
                             explicit_head_dim=128, query_pre_attn_scalar=168.0, **_LARGE),
}


def check_args(args: Gemma3Args) -> None:
    """What a Gemma 3 model refuses (the shared rules: ``models/presets.py``)."""
    if args.head_dim % 2:
        raise ConfigError(f"model.head_dim: {args.head_dim} must be even for RoPE")
    if args.layer_types is not None and len(args.layer_types) != args.n_layers:
        raise ConfigError(f"model.n_layers: {args.n_layers} layers, but the model's "
                          f"layer_types lists {len(args.layer_types)}")
    if args.sliding_window is None and "sliding" in args.attention_kinds:
        raise ConfigError("model.sliding_window: Gemma 3's sliding layers need a window")
