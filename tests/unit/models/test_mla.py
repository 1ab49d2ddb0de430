"""Multi-head latent attention (models/mla.py) against transformers' DeepseekV3Attention,
weights copied by name: causal, YaRN with DeepSeek's mscale, both rotary layouts,
incremental decoding through a KVCache, and a packed batch's DocumentMask."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention, DeepseekV3RotaryEmbedding)

from lmforge.models.attention import DocumentMask
from lmforge.models.common import KVCache
from lmforge.models.mla import MLAArgs, MLAttention, YarnScaling

# The values' head dim (10) differs from the keys' (8 + 4) on purpose.
ARGS = MLAArgs(dim=64, n_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
               qk_rope_head_dim=4, v_head_dim=10)
# Original context 16, so positions from 20 on are past it; mscale != mscale_all_dim, so
# cos/sin and the softmax are both rescaled.
YARN = YarnScaling(factor=4.0, original_max_position_embeddings=16, beta_fast=32.0,
                   beta_slow=1.0, mscale=0.707, mscale_all_dim=1.0)
TOLERANCE = 1e-5


def hf_config(args: MLAArgs) -> DeepseekV3Config:
    rope, context = {"rope_type": "default", "rope_theta": args.rope_theta}, 128
    if args.rope_scaling is not None:
        s = args.rope_scaling
        rope = {"rope_type": "yarn", "rope_theta": args.rope_theta, "factor": s.factor,
                "original_max_position_embeddings": s.original_max_position_embeddings,
                "beta_fast": s.beta_fast, "beta_slow": s.beta_slow, "mscale": s.mscale,
                "mscale_all_dim": s.mscale_all_dim}
        context = int(s.factor * s.original_max_position_embeddings)  # (else it warns)
    return DeepseekV3Config(
        hidden_size=args.dim, num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_heads, q_lora_rank=args.q_lora_rank,
        kv_lora_rank=args.kv_lora_rank, qk_nope_head_dim=args.qk_nope_head_dim,
        qk_rope_head_dim=args.qk_rope_head_dim, v_head_dim=args.v_head_dim,
        rope_parameters=rope, rope_interleave=args.rope_interleave,
        attention_bias=args.attention_bias, rms_norm_eps=args.norm_eps,
        max_position_embeddings=context, attn_implementation="eager")


@torch.no_grad()
def randomize(module: torch.nn.Module) -> None:
    """Every weight random, the norms' too (ones would hide a missing or misplaced norm)."""
    g = torch.Generator().manual_seed(0)
    for name, p in module.named_parameters():
        noise = torch.randn(p.shape, generator=g)
        if "layernorm" in name:
            p.copy_(1 + 0.3 * noise)
        elif p.dim() == 2:
            p.copy_(noise * p.shape[1] ** -0.5)
        else:  # a bias
            p.copy_(0.1 * noise)


def pair(**overrides):
    """(ours, transformers' attention, its rotary embedding), the same weights."""
    args = dataclasses.replace(ARGS, **overrides)
    config = hf_config(args)
    reference = DeepseekV3Attention(config, layer_idx=0).eval()
    randomize(reference)
    ours = MLAttention(args).eval()
    ours.load_state_dict(reference.state_dict())  # strict: the names are transformers'
    return ours, reference, DeepseekV3RotaryEmbedding(config)


@torch.no_grad()
def reference_forward(reference, rotary, x, positions):
    """transformers' causal attention (eager takes the mask as an additive one)."""
    seq = x.shape[1]
    allowed = torch.ones(seq, seq, dtype=torch.bool).tril()
    additive = torch.zeros(seq, seq).masked_fill(~allowed, float("-inf"))[None, None]
    return reference(x, rotary(x, positions), additive)[0]


def inputs(batch: int = 2, seq: int = 8, first: int = 0):
    x = torch.randn(batch, seq, ARGS.dim, generator=torch.Generator().manual_seed(1))
    return x, torch.arange(first, first + seq).expand(batch, seq)


CASES = {
    "causal": {},
    "no_q_lora": {"q_lora_rank": None},
    "biased": {"attention_bias": True},
    "rotate_half_layout": {"rope_interleave": False},
    "yarn": {"rope_scaling": YARN},
    "yarn_rotate_half_no_q_lora": {"rope_scaling": YARN, "rope_interleave": False,
                                   "q_lora_rank": None},
    "yarn_mscale_equal": {"rope_scaling": dataclasses.replace(YARN, mscale=1.0)},
}


@pytest.mark.parametrize("overrides", CASES.values(), ids=CASES.keys())
@torch.no_grad()
def test_matches_transformers(overrides):
    ours, reference, rotary = pair(**overrides)
    first = 20 if "rope_scaling" in overrides else 0  # past the original context
    x, positions = inputs(first=first)
    expected = reference_forward(reference, rotary, x, positions)
    got = ours(x, positions if first else None)
    torch.testing.assert_close(got, expected, atol=TOLERANCE, rtol=0)
    assert ours.softmax_scale == pytest.approx(reference.scaling, rel=1e-12)


def test_yarn_scales_as_transformers():
    _, reference, rotary = pair(rope_scaling=YARN)
    assert YARN.cos_sin_scale == pytest.approx(rotary.attention_scaling, rel=1e-12)
    assert YARN.cos_sin_scale != 1.0 and YARN.softmax_scale_factor > 1.0
    assert reference.scaling == pytest.approx(
        (8 + 4) ** -0.5 * YARN.softmax_scale_factor, rel=1e-12)


@torch.no_grad()
def test_kv_cache_decode_equals_full_forward():
    ours, reference, rotary = pair(rope_scaling=YARN)
    x, positions = inputs(seq=8)
    full = ours(x)
    torch.testing.assert_close(full, reference_forward(reference, rotary, x, positions),
                               atol=TOLERANCE, rtol=0)
    cache = KVCache.empty(ours.args, x.shape[0], 8, "cpu", torch.float32)
    assert cache.k.shape == (2, 4, 8, 12) and cache.v.shape == (2, 4, 8, 10)
    pieces = [ours(x[:, :5], cache=cache)]
    for i in range(5, 8):
        pieces.append(ours(x[:, i:i + 1], cache=cache))
    assert cache.length == 8
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=TOLERANCE, rtol=0)


@torch.no_grad()
def test_document_mask_equals_each_document_alone():
    ours, reference, rotary = pair(rope_scaling=YARN)
    x, _ = inputs(batch=1, seq=10)
    lengths = (6, 4)
    segments = torch.tensor([[0] * lengths[0] + [1] * lengths[1]])
    positions = torch.cat([torch.arange(n) for n in lengths])[None]  # restart per document
    packed = ours(x, positions, DocumentMask(segments))
    for doc, part in zip(x.split(lengths, dim=1), packed.split(lengths, dim=1)):
        alone = ours(doc)
        torch.testing.assert_close(part, alone, atol=TOLERANCE, rtol=0)
        expected = reference_forward(reference, rotary, doc, torch.arange(doc.shape[1])[None])
        torch.testing.assert_close(part, expected, atol=TOLERANCE, rtol=0)


def test_cache_with_narrower_values():
    """KVCache sizes values by ``v_head_dim``, also when tensor parallelism resizes it
    at the first write to this rank's heads."""
    cache = KVCache.empty(ARGS, 1, 6, "cpu", torch.float32)
    k, v = cache.append(torch.randn(1, 2, 3, 12), torch.randn(1, 2, 3, 10))
    assert k.shape == (1, 2, 3, 12) and v.shape == (1, 2, 3, 10)
    n_layers = 3
    with_layers = type("Args", (), {"n_layers": n_layers, "n_kv_heads": 4, "head_dim": 12,
                                    "v_head_dim": 10})
    assert KVCache.bytes_per_token(with_layers, torch.bfloat16) == n_layers * 4 * (12 + 10) * 2


@pytest.mark.parametrize("q_lora_rank", [24, None])
@torch.no_grad()
def test_reset_parameters(q_lora_rank):
    with torch.device("meta"):
        module = MLAttention(dataclasses.replace(ARGS, q_lora_rank=q_lora_rank,
                                                 attention_bias=True))
    module.to_empty(device="cpu")
    module.reset_parameters(std=0.02, out_std=0.005)
    for name, p in module.named_parameters():
        if "layernorm" in name:
            assert torch.equal(p, torch.ones_like(p)), name
        elif name.endswith("bias"):
            assert torch.equal(p, torch.zeros_like(p)), name
        else:
            bound = 3 * (0.005 if name.startswith("o_proj") else 0.02)
            assert p.abs().max() <= bound and p.std() > bound / 6, name
