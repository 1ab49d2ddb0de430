"""Named sizes of Mixtral, from the released config.json files, and a test size. An
expert's width is config.json's intermediate_size, so ``ffn_dim`` (the dense layers'
width, of which Mixtral has none) is the same number, as loading a config.json gives."""
from __future__ import annotations

from lmforge.models.qwen3_moe.model import SparseArgs
from lmforge.models.qwen3_moe.presets import check_args

__all__ = ["PRESETS", "check_args"]

_MIXTRAL = dict(family="mixtral", n_kv_heads=8, n_experts=8, top_k=2, norm_topk_prob=True,
                rope_theta=1e6, norm_eps=1e-5)

PRESETS: dict[str, SparseArgs] = {
    # 8 experts of width 64, top-2
    "mixtral-debug": SparseArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=259,
                                ffn_dim=64, moe_ffn_dim=64, max_seq_len=512, family="mixtral",
                                n_experts=8, top_k=2, norm_topk_prob=True),
    # 46,702,792,704 parameters, as published and as transformers builds it
    "mixtral-8x7b": SparseArgs(dim=4096, n_layers=32, n_heads=32, vocab_size=32000,
                               ffn_dim=14336, moe_ffn_dim=14336, max_seq_len=32768,
                               **_MIXTRAL),
    # 140,630,071,296 parameters, as transformers builds it
    "mixtral-8x22b": SparseArgs(dim=6144, n_layers=56, n_heads=48, vocab_size=32768,
                                ffn_dim=16384, moe_ffn_dim=16384, max_seq_len=65536,
                                **_MIXTRAL),
}
