"""Named model sizes. The published ones follow each model's released config.json."""
from __future__ import annotations

from lmforge.models.llama import LlamaArgs, RopeScaling

_LLAMA31_SCALING = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                               original_max_position_embeddings=8192)
_LLAMA32_SCALING = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                               original_max_position_embeddings=8192)

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
}
