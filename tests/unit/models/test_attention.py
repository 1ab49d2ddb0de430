"""The one attention path (models/attention.py): FlexAttention with block masks built
from a packed batch's documents gives the logits and loss of SDPA with the dense mask,
for every family, on packed pretraining rows (documents cut at window boundaries) and
packed SFT rows (samples, then padding as a segment of its own), with and without a
sliding window (fp32 CPU, 1e-5). PyTorch's FlexAttention has no backward on the CPU, so
here it is compared forward (the gradients: tests/gpu); on the CPU a flex training run
is refused, naming model.attention. Flex runs uncompiled in these tests (compiling costs
tens of seconds per shape; compiled and uncompiled run the same mask function), except
one slow test that compiles it."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers.packed import SEQ, attention_families, pretrain_batch, sft_batch
from lmforge.config import ConfigError, load_config
from lmforge.job import resolve
from lmforge.models import attention
from lmforge.models.attention import DocumentMask, attend
from lmforge.models.common import materialize
from lmforge.models.loss import model_inputs, token_loss_sum
from lmforge.models.registry import build_model

FAMILIES = attention_families()
COMPILED_FLEX = attention._flex  # (the fixture below swaps it for the uncompiled one)


@pytest.fixture(autouse=True)
def uncompiled_flex(monkeypatch):
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(attention, "_flex", lambda: flex_attention)
    monkeypatch.setattr(attention, "COMPILE_BLOCK_MASKS", False)


def _model(args, kind: str):
    torch.manual_seed(0)
    model = materialize(build_model(args), "cpu").eval()
    model.attention = kind
    return model


@pytest.mark.parametrize("data", ["pretrain", "sft"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_flex_with_document_masks_equals_sdpa_with_the_dense_mask(family, data):
    args = FAMILIES[family]
    batch = (pretrain_batch if data == "pretrain" else sft_batch)(args.vocab_size)
    assert len(batch["segments"][0].unique()) >= 3
    results = {}
    for kind in ("sdpa", "flex"):
        with torch.no_grad():
            logits = _model(args, kind)(**model_inputs(batch, torch.device("cpu")))
        results[kind] = logits, token_loss_sum(logits, batch["labels"])
    torch.testing.assert_close(results["flex"][0], results["sdpa"][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results["flex"][1], results["sdpa"][1], rtol=1e-5, atol=1e-5)


def test_a_packed_row_equals_its_documents_run_one_by_one():
    """What both kinds implement: no token sees another document (positions restart)."""
    args = FAMILIES["mistral"]
    batch = pretrain_batch(args.vocab_size)
    model = _model(args, "flex")
    with torch.no_grad():
        packed = model(**model_inputs(batch, torch.device("cpu")))[0]
        segments = batch["segments"][0]
        for doc in segments.unique()[:-1]:  # (the last: padding)
            where = (segments == doc).nonzero().flatten()
            alone = model(batch["input_ids"][:1, where])[0]
            torch.testing.assert_close(packed[where], alone, rtol=1e-5, atol=1e-5)


def test_a_sliding_window_without_documents_is_a_block_mask_under_flex():
    args = FAMILIES["mistral"]
    tokens = torch.randint(0, args.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(_model(args, "flex")(tokens), _model(args, "sdpa")(tokens),
                                   rtol=1e-5, atol=1e-5)


def test_attend_builds_each_mask_once_per_batch_and_window():
    q = torch.randn(1, 4, SEQ, 8)
    mask = DocumentMask(torch.tensor([[0] * 10 + [1] * 14]))
    attend(q, q, q, mask, window=5)
    first = mask.dense(5, 1, SEQ, "cpu")
    attend(q, q, q, mask, window=5)
    assert mask.dense(5, 1, SEQ, "cpu") is first and len(mask.tensors()) == 2
    allowed = first[0, 0]
    assert allowed[12, 10] and not allowed[12, 9] and not allowed[17, 12]  # doc, window


def test_grouped_heads_repeated_for_a_masked_kernel_give_sdpas_grouped_result():
    """The CUDA path of a mask with grouped heads (attention._sdpa repeats k and v to
    every head there, as no fused kernel takes both) equals enable_gqa's pairing."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 10, 8, generator=g)
    k, v = torch.randn(2, 2, 10, 8, generator=g), torch.randn(2, 2, 10, 8, generator=g)
    mask = torch.rand(2, 1, 10, 10, generator=g) > 0.3
    mask |= torch.eye(10, dtype=torch.bool)  # (every query sees a key)
    grouped = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                               enable_gqa=True)
    repeated = torch.nn.functional.scaled_dot_product_attention(
        q, attention.repeat_heads(k, 6), attention.repeat_heads(v, 6), attn_mask=mask)
    torch.testing.assert_close(repeated, grouped, rtol=1e-6, atol=1e-6)


def test_a_flex_training_run_on_the_cpu_is_refused_naming_the_field():
    cfg = load_config(None, ["model.attention=flex", "train.device=cpu", "data.seq_len=32"])
    with pytest.raises(ConfigError, match="model.attention: flex cannot train on the CPU"):
        resolve(cfg, args=dataclasses.replace(FAMILIES["llama"]))


def test_flex_on_cuda_with_heads_under_16_features_is_refused_naming_the_field():
    """torch 2.11's compiled flex kernel refuses them (seen on an H200): the config says
    so before the run, not the compiler in its first step."""
    cfg = load_config(None, ["model.attention=flex", "train.device=cuda", "data.seq_len=32"])
    assert FAMILIES["llama"].head_dim < 16
    with pytest.raises(ConfigError, match="model.attention: flex needs at least 16 features"):
        resolve(cfg, args=dataclasses.replace(FAMILIES["llama"]))
    resolve(cfg, args=dataclasses.replace(FAMILIES["llama"], dim=64))  # 16 per head


@pytest.mark.slow
@pytest.mark.long
def test_compiled_flex_equals_sdpa_on_a_packed_batch(monkeypatch):
    monkeypatch.setattr(attention, "_flex", COMPILED_FLEX)
    monkeypatch.setattr(attention, "COMPILE_BLOCK_MASKS", True)
    args = FAMILIES["gemma3"]
    batch = sft_batch(args.vocab_size)
    with torch.no_grad():
        flex = _model(args, "flex")(**model_inputs(batch, torch.device("cpu")))
        sdpa = _model(args, "sdpa")(**model_inputs(batch, torch.device("cpu")))
    torch.testing.assert_close(flex, sdpa, rtol=1e-5, atol=1e-5)
