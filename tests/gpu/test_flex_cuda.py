"""On a CUDA device (``pytest -m gpu``; skipped without one): compiled FlexAttention with
a packed batch's block masks gives SDPA-with-the-dense-mask's loss and gradients (fp32,
1e-5 relative), for every family, with and without a sliding window. (On the CPU,
PyTorch's FlexAttention has no backward: tests/unit/models/test_attention.py compares the
forward there.)"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers.packed import attention_families, pretrain_batch, sft_batch
from lmforge.models.attention import FLEX_MIN_HEAD_DIM
from lmforge.models.common import materialize
from lmforge.models.loss import micro_batch_loss_sum
from lmforge.models.registry import build_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


# qwen2 joined after the H200 run of 2026-11-26, which passed the other six.
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gptj",
                                    "phi3-window", "gemma3"])
def test_compiled_flex_gives_sdpas_loss_and_gradients(family):
    args = heads_of_16(attention_families()[family])
    cuda = torch.device("cuda")
    for batch in (pretrain_batch(args.vocab_size), sft_batch(args.vocab_size)):
        grads, losses = {}, {}
        for kind in ("sdpa", "flex"):
            torch.manual_seed(0)
            model = materialize(build_model(args), "cuda")
            model.attention = kind
            loss = micro_batch_loss_sum(model, batch, cuda)
            loss.backward()
            losses[kind] = loss.detach()
            grads[kind] = {n: p.grad for n, p in model.named_parameters()}
        torch.testing.assert_close(losses["flex"], losses["sdpa"], rtol=1e-5, atol=1e-5)
        for name, grad in grads["sdpa"].items():
            torch.testing.assert_close(grads["flex"][name], grad, rtol=1e-5, atol=1e-5,
                                       msg=name)


def heads_of_16(args):
    """The family's tiny model with the 16 features per head compiled flex on CUDA needs
    at least (``FLEX_MIN_HEAD_DIM``); the CPU tests' tiny heads have 8 or 12."""
    head_dim, fields = FLEX_MIN_HEAD_DIM, {f.name for f in dataclasses.fields(args)}
    changes = {"dim": args.n_heads * head_dim}
    if "explicit_head_dim" in fields and args.explicit_head_dim:
        changes["explicit_head_dim"] = head_dim
    if "rotary_dim" in fields and args.rotary_dim:  # GPT-J rotates half of each head
        changes["rotary_dim"] = head_dim // 2
    return dataclasses.replace(args, **changes)


def test_masked_grouped_query_attention_keeps_no_seq_by_seq_scores():
    """A dense mask with grouped heads (documents, or context parallelism) must reach a
    fused kernel: SDPA's math fallback would allocate every score, heads x seq x seq."""
    from lmforge.models.attention import attend

    seq, heads, cuda = 4096, 8, torch.device("cuda")
    q = torch.randn(1, heads, seq, 64, device=cuda, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, 2, seq, 64, device=cuda, dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    mask = torch.ones(seq, seq, dtype=torch.bool, device=cuda).tril()[None, None]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    attend(q, k, v, mask).sum().backward()
    # SDPA's math path holds the scores and their softmax, heads x seq x seq each (twice
    # this); a fused kernel's extra is the mask made additive, seq x seq (an eighth of it).
    # Measured on an H200 (torch 2.11): 0.27 of it.
    scores = heads * seq * seq * 2  # bf16
    assert torch.cuda.max_memory_allocated() - before < scores / 2
