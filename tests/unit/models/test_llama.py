"""The Llama model: norm, KV cache, positions, tying, and the published preset sizes."""
from __future__ import annotations

import pytest
import torch

from helpers.tiny_models import tiny_llama_args
from lmforge.models.llama import (
    LlamaArgs, RMSNorm, RopeScaling, build_llama, count_parameters, materialize)
from lmforge.models.presets import PRESETS
from lmforge.models.common import new_caches

SMALL = tiny_llama_args(dim=64, vocab_size=101, ffn_dim=160, max_seq_len=128,
                        rope_scaling=RopeScaling(original_max_position_embeddings=32))


def small_model(seed: int = 0, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    args = LlamaArgs(**{**SMALL.__dict__, **overrides})
    return materialize(build_llama(args), "cpu").eval()


def tokens(batch: int = 2, seq: int = 16, vocab: int = 101) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))


# ---------------------------------------------------------------------------- RMSNorm

def rms_norm_float64(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return weight.double() * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@torch.no_grad()
def test_rms_norm_matches_float64_reference(dtype, tolerance):
    norm = RMSNorm(48, eps=1e-5)
    norm.weight.normal_(1.0, 0.2, generator=torch.Generator().manual_seed(0))
    x = (torch.randn(3, 5, 48, generator=torch.Generator().manual_seed(1)) * 7).to(dtype)
    out = norm.to(dtype)(x)
    assert out.dtype == dtype
    reference = rms_norm_float64(x, norm.weight, norm.eps)
    assert ((out.double() - reference).abs().max() / reference.abs().max()).item() <= tolerance


# ------------------------------------------------------------------------ forward paths

@pytest.mark.parametrize("chunks", [[16], [10, 1, 1, 1, 1, 1, 1], [5, 6, 1, 4]],
                         ids=["prefill_all", "prefill_then_one_by_one", "mixed_chunks"])
@torch.no_grad()
def test_kv_cache_decode_equals_full_forward(chunks):
    model = small_model()
    ids = tokens()
    full = model(ids)
    caches = new_caches(model, ids.shape[0], ids.shape[1])
    start, pieces = 0, []
    for size in chunks:
        pieces.append(model(ids[:, start:start + size], caches=caches))
        start += size
    assert start == ids.shape[1] and caches[0].length == ids.shape[1]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_kv_cache_refuses_to_overflow():
    model = small_model()
    caches = new_caches(model, 1, 4)
    with pytest.raises(ValueError, match="KV cache full"):
        model(tokens(batch=1, seq=5), caches=caches)


@torch.no_grad()
def test_explicit_positions_equal_default_positions():
    model = small_model()
    ids = tokens()
    positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
    assert torch.equal(model(ids, positions=positions), model(ids))


@torch.no_grad()
def test_shifted_positions_change_the_output():
    """Positions actually reach RoPE: shifting them changes logits (beyond position 0)."""
    model = small_model()
    ids = tokens()
    positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1) + 7
    assert not torch.allclose(model(ids, positions=positions), model(ids))


@torch.no_grad()
def test_tied_model_has_one_embedding_storage():
    model = small_model(tie_embeddings=True)
    assert model.output.weight is model.tok_embeddings.weight
    sd = model.state_dict()
    assert sd["output.weight"].data_ptr() == sd["tok_embeddings.weight"].data_ptr()
    untied = small_model(tie_embeddings=False)
    assert count_parameters(untied) - count_parameters(model) == 101 * 64


# ---------------------------------------------------------------------------- presets

PUBLISHED_PARAMETERS = {
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama2-70b": 68_976_648_192,
    "llama3-8b": 8_030_261_248,
    "llama3.1-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3.2-1b": 1_235_814_400,
    "llama3.2-3b": 3_212_749_824,
}


@pytest.mark.parametrize("preset", PUBLISHED_PARAMETERS)
def test_preset_parameter_count_equals_published_and_building_allocates_nothing(preset):
    model = build_llama(PRESETS[preset])
    assert count_parameters(model) == PUBLISHED_PARAMETERS[preset]
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
