"""Named sizes of Qwen3.5-MoE's language models (the released config.json files'
``text_config``), and a test size. ``ffn_dim`` is an expert's width, as loading a
config.json gives (there are no dense layers).

Where each value was checked (no value changed): shared by both (``_QWEN3_5``):
vocab_size 248320, rope_theta 1e7, rms_norm_eps 1e-6, head_dim 256, 2 KV heads, 16 key
heads of 128 and value heads of 128, untied embeddings: THUDM/slime's conversion
recipes (scripts/models/qwen3.5-35B-A3B.sh, qwen3.5-397B-A17B.sh); 262144 positions,
partial_rotary_factor 0.25, conv kernel 4, every fourth layer full: a public copy of the
text_config of a Qwen3.5-35B-A3B fine-tune (the same architecture) and the model cards.
"""
from __future__ import annotations

from lmforge.models.qwen3_5.presets import every_fourth_full
from lmforge.models.qwen3_next.model import HybridSparseArgs
from lmforge.models.qwen3_next.presets import check_args

__all__ = ["PRESETS", "check_args"]

_QWEN3_5 = dict(family="qwen3_5_moe_text", vocab_size=248320, max_seq_len=262144,
                rope_theta=1e7, norm_eps=1e-6, qk_norm=True, explicit_head_dim=256,
                n_kv_heads=2, linear_key_heads=16, linear_key_head_dim=128,
                linear_value_head_dim=128)

PRESETS: dict[str, HybridSparseArgs] = {
    # 4 layers (linear x 3, full), 16 experts of width 32 (top-4) and a shared one of 64
    "qwen3.5-moe-debug": HybridSparseArgs(
        dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=259, ffn_dim=32,
        max_seq_len=512, explicit_head_dim=16, qk_norm=True, layer_types=every_fourth_full(4),
        linear_key_heads=2, linear_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, n_experts=16, top_k=4, moe_ffn_dim=32, shared_ffn_dim=64,
        family="qwen3_5_moe_text"),
    # Qwen/Qwen3.5-35B-A3B: 256 experts, top-8. hidden 2048, 40 layers, 16 heads, 32 value
    # heads, experts and shared expert 512 wide: slime's recipe, transformers 5.24's
    # Qwen3_5MoeTextConfig defaults (this checkpoint's) and the fine-tune's text_config.
    "qwen3.5-35b-a3b": HybridSparseArgs(
        dim=2048, n_layers=40, n_heads=16, ffn_dim=512, layer_types=every_fourth_full(40),
        linear_value_heads=32, n_experts=256, top_k=8, moe_ffn_dim=512, shared_ffn_dim=512,
        **_QWEN3_5),
    # Qwen/Qwen3.5-397B-A17B: 512 experts, top-10. hidden 4096, 60 layers, 32 heads, 64
    # value heads, experts and shared expert 1024 wide: slime's recipe (whose conversion
    # must match the checkpoint's shapes) and the model card. One public test fixture
    # (Megatron-Bridge's, "a sample") has a shared width of 4096; no copy of the release
    # found says so.
    "qwen3.5-397b-a17b": HybridSparseArgs(
        dim=4096, n_layers=60, n_heads=32, ffn_dim=1024, layer_types=every_fourth_full(60),
        linear_value_heads=64, n_experts=512, top_k=10, moe_ffn_dim=1024,
        shared_ffn_dim=1024, **_QWEN3_5),
}
