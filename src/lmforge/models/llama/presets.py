"""Named sizes of the Llama-shaped families (Llama 2/3/3.1/3.2, Mistral, Qwen2.5, Qwen3);
the published ones follow each model's released config.json."""
from __future__ import annotations

from lmforge.config import ConfigError
from lmforge.models.llama.hf import VARIANTS
from lmforge.models.llama.model import LlamaArgs, RopeScaling

_LLAMA31_SCALING = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                               original_max_position_embeddings=8192)
_LLAMA32_SCALING = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                               original_max_position_embeddings=8192)


def _shape(dim, n_layers, n_heads, ffn_dim, vocab_size, tie_embeddings) -> dict:
    return dict(dim=dim, n_layers=n_layers, n_heads=n_heads, ffn_dim=ffn_dim,
                vocab_size=vocab_size, tie_embeddings=tie_embeddings)


PRESETS: dict[str, LlamaArgs] = {
    # Test and demo sizes. "tiny" trains on 2 CPU cores in minutes.
    "debug": LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=259,
                       ffn_dim=176, max_seq_len=512),
    "tiny": LlamaArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=2048,
                      ffn_dim=688, max_seq_len=1024, tie_embeddings=True),
    "small": LlamaArgs(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, vocab_size=32000,
                       ffn_dim=1376, max_seq_len=2048),
    "llama2-7b": LlamaArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, vocab_size=32000,
                           ffn_dim=11008, max_seq_len=4096),
    "llama2-13b": LlamaArgs(dim=5120, n_layers=40, n_heads=40, n_kv_heads=40,
                            vocab_size=32000, ffn_dim=13824, max_seq_len=4096),
    "llama2-70b": LlamaArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=32000,
                            ffn_dim=28672, max_seq_len=4096),
    "llama3-8b": LlamaArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
                           ffn_dim=14336, max_seq_len=8192, rope_theta=500000.0),
    "llama3-70b": LlamaArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                            vocab_size=128256, ffn_dim=28672, max_seq_len=8192,
                            rope_theta=500000.0),
    "llama3.1-8b": LlamaArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                             vocab_size=128256, ffn_dim=14336, max_seq_len=131072,
                             rope_theta=500000.0, rope_scaling=_LLAMA31_SCALING),
    "llama3.2-1b": LlamaArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                             vocab_size=128256, ffn_dim=8192, max_seq_len=131072,
                             rope_theta=500000.0, rope_scaling=_LLAMA32_SCALING,
                             tie_embeddings=True),
    "llama3.2-3b": LlamaArgs(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8,
                             vocab_size=128256, ffn_dim=8192, max_seq_len=131072,
                             rope_theta=500000.0, rope_scaling=_LLAMA32_SCALING,
                             tie_embeddings=True),
    "mistral-7b": LlamaArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=32000,
                            ffn_dim=14336, max_seq_len=32768, family="mistral",
                            sliding_window=4096),
    **{name: LlamaArgs(**shape, n_kv_heads=kv, max_seq_len=max_len, rope_theta=1e6,
                       norm_eps=1e-6, family="qwen2", attention_bias=True)
       for name, shape, kv, max_len in (
           ("qwen2.5-0.5b", _shape(896, 24, 14, 4864, 151936, True), 2, 32768),
           ("qwen2.5-1.5b", _shape(1536, 28, 12, 8960, 151936, True), 2, 131072),
           ("qwen2.5-7b", _shape(3584, 28, 28, 18944, 152064, False), 4, 131072))},
    **{name: LlamaArgs(**shape, n_kv_heads=8, max_seq_len=40960, rope_theta=1e6,
                       norm_eps=1e-6, family="qwen3", explicit_head_dim=128, qk_norm=True)
       for name, shape in (
           ("qwen3-0.6b", _shape(1024, 28, 16, 3072, 151936, True)),
           ("qwen3-1.7b", _shape(2048, 28, 16, 6144, 151936, True)),
           ("qwen3-8b", _shape(4096, 36, 32, 12288, 151936, False)))},
}


def check_args(args: LlamaArgs) -> None:
    """What only a Llama-shaped model refuses (the shared rules: ``models/presets.py``)."""
    if args.explicit_head_dim is None and args.dim % args.n_heads:
        raise ConfigError(f"model.n_heads: dim ({args.dim}) must be divisible by "
                          f"n_heads ({args.n_heads})")
    if args.sliding_window is not None and VARIANTS[args.family].window_key != "sliding_window":
        raise ConfigError(f"model.sliding_window: model_type {args.family!r} has no sliding "
                          f"window in transformers (model.family=mistral has one)")
    if args.head_dim % 2:
        raise ConfigError(f"model.n_heads: head_dim ({args.head_dim}) must be even for RoPE")
