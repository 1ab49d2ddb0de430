"""On a CUDA device (``pytest -m gpu``; skipped without one): the GPU computes what the
CPU does. Run by ``make gpu-check`` before the training paths."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers.tiny_models import tiny_llama_args
from lmforge.models.llama import build_llama, materialize
from lmforge.models.loss import micro_batch_loss_sum
from lmforge.peft.quant import QuantizedLinear

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ARGS = tiny_llama_args(dim=128, vocab_size=301, ffn_dim=352, max_seq_len=256)


def _batch(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, ARGS.vocab_size, (2, 129), generator=g)
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}


def test_bf16_autocast_loss_on_gpu_matches_fp32_loss_on_cpu():
    torch.manual_seed(0)
    model = materialize(build_llama(ARGS), "cpu")
    batch = _batch()
    n = batch["labels"].numel()
    with torch.no_grad():
        cpu = micro_batch_loss_sum(model, batch, torch.device("cpu")).item() / n
        gpu_model = model.to("cuda")
        cuda = torch.device("cuda")
        bf16 = micro_batch_loss_sum(
            gpu_model, batch, cuda,
            lambda: torch.autocast("cuda", dtype=torch.bfloat16)).item() / n
        fp32 = micro_batch_loss_sum(gpu_model, batch, cuda).item() / n
    assert fp32 == pytest.approx(cpu, rel=1e-4)
    assert bf16 == pytest.approx(cpu, rel=2e-2)


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_dequantize_on_cuda_equals_the_cpu_result(fmt):
    torch.manual_seed(0)
    linear = nn.Linear(512, 384, bias=False)
    on_cpu = QuantizedLinear.from_linear(linear, fmt).dequantize(torch.float32)
    on_gpu = QuantizedLinear.from_linear(linear, fmt, device="cuda").dequantize(torch.float32)
    # The same codes and scales, but the GPU may fuse a multiply-add the CPU rounds twice
    # (seen on an H200: 2.4e-7 relative at most).
    torch.testing.assert_close(on_gpu.cpu(), on_cpu, rtol=1e-6, atol=0)


def test_fused_adamw_step_equals_the_unfused_step():
    torch.manual_seed(0)
    params = [torch.randn(256, 128, device="cuda"), torch.randn(128, device="cuda")]
    grads = [torch.randn_like(p) for p in params]
    results = []
    for fused in (True, False):
        copies = [nn.Parameter(p.clone()) for p in params]
        opt = torch.optim.AdamW(copies, lr=1e-3, weight_decay=0.1, fused=fused,
                                foreach=None if fused else False)
        for _ in range(3):
            for c, g in zip(copies, grads):
                c.grad = g.clone()
            opt.step()
        results.append([c.detach() for c in copies])
    for fused, plain in zip(*results):
        torch.testing.assert_close(fused, plain, rtol=1e-6, atol=1e-7)
