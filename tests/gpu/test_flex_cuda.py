"""On a CUDA device (``pytest -m gpu``; skipped without one): compiled FlexAttention with
a packed batch's block masks gives SDPA-with-the-dense-mask's loss and gradients (fp32,
1e-5 relative), for every family, with and without a sliding window. (On the CPU,
PyTorch's FlexAttention has no backward: tests/unit/models/test_attention.py compares the
forward there.)"""
from __future__ import annotations

import pytest
import torch

from helpers.packed import attention_families, pretrain_batch, sft_batch
from lmforge.models.common import materialize
from lmforge.models.loss import micro_batch_loss_sum
from lmforge.models.registry import build_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3", "gptj", "phi3-window",
                                    "gemma3"])
def test_compiled_flex_gives_sdpas_loss_and_gradients(family):
    args = attention_families()[family]
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
