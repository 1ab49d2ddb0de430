"""NF4 / int8 frozen bases (QLoRA): formats, the dequantize-on-the-fly linear, training on
CPU, and merging through a 16-bit dequantized base."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lmforge.config import OptimConfig
from lmforge.models.hf import load_hf_model
from lmforge.models.llama import build_llama, materialize
from lmforge.peft import (LoraError, QuantizedLinear, after_materialize, count_trainable,
                          dequantize_base, export_merged, is_quantized, lora_layers,
                          merge_lora, prepare_model_for_lora, quantize_base,
                          trainable_summary)
from lmforge.peft.quant import NF4_LEVELS, nf4_levels_from_quantiles
from lmforge.train.optim import build_optimizer


def test_nf4_levels_are_the_normal_quantiles_of_qlora():
    derived = nf4_levels_from_quantiles()
    torch.testing.assert_close(derived.float(), torch.tensor(NF4_LEVELS), rtol=0, atol=1e-6)


@pytest.mark.parametrize("double_quant", [True, False])
def test_nf4_round_trip_error_and_stable_codes(double_quant):
    torch.manual_seed(0)
    linear = nn.Linear(176, 50)  # 8800 values: 137.5 blocks, the last one padded
    q = QuantizedLinear.from_linear(linear, "nf4", double_quant)
    assert q.weight_nf4.dtype == torch.uint8 and q.weight_nf4.numel() == 138 * 64 // 2
    w, deq = linear.weight.detach(), q.dequantize()
    # Per block the error is at most half the widest gap between levels times the absmax.
    blocks = torch.nn.functional.pad(w.reshape(-1), (0, 32)).view(-1, 64)
    err = torch.nn.functional.pad((deq - w).reshape(-1), (0, 32)).view(-1, 64)
    widest_gap = max(b - a for a, b in zip(NF4_LEVELS, NF4_LEVELS[1:]))
    slack = 1.02 if double_quant else 1.0001  # int8 absmaxes are off by < 1%
    assert (err.abs().amax(1) <= blocks.abs().amax(1) * widest_gap / 2 * slack + 1e-7).all()
    assert (deq - w).abs().mean() / w.abs().mean() < 0.12
    again = QuantizedLinear.from_linear(q.to_linear(torch.float32), "nf4", double_quant)
    assert torch.equal(again.weight_nf4, q.weight_nf4)  # the levels are fixed points


def test_int8_round_trip_error():
    torch.manual_seed(0)
    linear = nn.Linear(64, 40)
    q = QuantizedLinear.from_linear(linear, "int8")
    assert q.weight_int8.dtype == torch.int8
    w = linear.weight.detach()
    step = w.abs().amax(1, keepdim=True) / 127
    assert ((q.dequantize() - w).abs() <= step / 2 + 1e-7).all()


def test_quantized_linear_gradients_and_saved_tensors():
    torch.manual_seed(0)
    linear = nn.Linear(128, 96, bias=True)
    q = QuantizedLinear.from_linear(linear, "nf4")
    x = torch.randn(3, 7, 128, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = q(x)
    # QLoRA's memory saving: no dequantized (96, 128) weight is kept for backward.
    assert not any(t.shape == (96, 128) and t.is_floating_point() for t in saved)
    grad = torch.randn_like(y)
    y.backward(grad)
    x_ref = x.detach().clone().requires_grad_(True)
    w = q.dequantize()
    y_ref = F.linear(x_ref, w, linear.bias.detach())
    y_ref.backward(grad)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(x.grad, x_ref.grad)
    assert not any(p.requires_grad for p in q.parameters())


def test_quantized_forward_under_bf16_autocast():
    torch.manual_seed(0)
    q = QuantizedLinear.from_linear(nn.Linear(64, 32), "nf4")
    x = torch.randn(2, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = q(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32


def _qlora_model(lib, fmt="nf4", targets="all-linear"):
    model = build_llama(lib.TINY)  # meta, as the trainer builds it
    cfg = lib.lora_cfg(targets=targets, quantize=fmt, rank=8, alpha=16.0)
    prepare_model_for_lora(model, cfg)
    torch.manual_seed(0)
    materialize(model, "cpu")
    after_materialize(model, cfg)
    return model


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_qlora_trains_the_adapters_on_cpu_and_the_loss_falls(lib, fmt):
    model = _qlora_model(lib, fmt).train()
    assert is_quantized(model)
    codes = {n: p.clone() for n, p in model.named_parameters() if not p.is_floating_point()}
    assert codes  # the base is stored as integer codes
    optimizer = build_optimizer(model, OptimConfig(lr=1e-2, weight_decay=0.0))
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == {
        id(p) for n, p in model.named_parameters() if n.endswith(("lora_a", "lora_b"))}
    x = lib.tokens(batch=4, seq=24, seed=5)
    inputs, labels = x[:, :-1], x[:, 1:]
    losses = []
    for _ in range(25):
        loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
        loss.backward()
        assert all(p.grad is None for n, p in model.named_parameters()
                   if not n.endswith(("lora_a", "lora_b")))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.85 * losses[0], losses
    for n, p in model.named_parameters():
        if n in codes:
            assert torch.equal(p, codes[n]), n


def test_trainable_summary_counts_quantized_weights_as_weights(lib):
    model = _qlora_model(lib)
    plain = build_llama(lib.TINY)
    prepare_model_for_lora(plain, lib.lora_cfg(targets="all-linear", rank=8))
    assert count_trainable(model) == count_trainable(plain)
    assert "trainable /" in trainable_summary(model)


@torch.no_grad()
def test_merging_into_a_quantized_base_is_refused_then_done_through_dequantization(lib):
    model = _qlora_model(lib).eval()
    lib.randomize_adapters(model, scale=0.1)
    x = lib.tokens()
    qlora = model(x)
    with pytest.raises(LoraError, match="nf4-quantized base .* dequantize it to 16-bit first"):
        merge_lora(model)
    dequantize_base(model, torch.float32)
    assert not is_quantized(model)
    assert lib.max_rel_err(model(x), qlora) < 1e-5  # same weights, now plain fp32
    merge_lora(model)
    assert lib.max_rel_err(model(x), qlora) < 1e-5


@torch.no_grad()
def test_export_merged_from_a_quantized_base(lib, tmp_path):
    model = _qlora_model(lib).eval()
    lib.randomize_adapters(model, scale=0.1)
    x = lib.tokens()
    qlora = model(x)
    export_merged(model, tmp_path / "fp32", dtype=torch.float32)
    assert is_quantized(model)  # the model itself is untouched
    merged = load_hf_model(tmp_path / "fp32").eval()
    assert lib.max_rel_err(merged(x), qlora) < 1e-5
    export_merged(model, tmp_path / "bf16")  # default for a quantized base: bf16
    merged16 = load_hf_model(tmp_path / "bf16")
    assert merged16.layers["0"].attention.q_proj.weight.dtype == torch.bfloat16
    assert lib.max_rel_err(merged16.float().eval()(x), qlora) < 2e-2


def test_quantize_only_what_is_asked_and_only_when_materialised(lib):
    model = lib.tiny_model()
    done = quantize_base(model, "int8", ["gate_proj"])
    assert done == ["layers.0.feed_forward.gate_proj", "layers.1.feed_forward.gate_proj"]
    assert isinstance(model.layers["0"].feed_forward.gate_proj, QuantizedLinear)
    assert type(model.output) is nn.Linear  # the head is never quantized
    assert len(quantize_base(model, "nf4", ["up_proj"], device="cpu")) == 2
    with pytest.raises(ValueError, match="meta device"):
        quantize_base(build_llama(lib.TINY), "nf4")
    with pytest.raises(ValueError, match="'fp8' is not one of"):
        quantize_base(model, "fp8")


def test_lora_over_a_biased_quantized_linear(lib):
    from lmforge.peft import apply_lora

    torch.manual_seed(0)
    net = nn.Sequential()
    net.add_module("q_proj", nn.Linear(64, 32, bias=True))
    quantize_base(net, "nf4", ["q_proj"])
    x = torch.randn(2, 64)
    with torch.no_grad():
        before = net(x)
    apply_lora(net, lib.lora_cfg(targets=["q_proj"]))
    layer = net.q_proj
    assert layer.bias is not None and layer.quantized.bias is None  # the bias moved once
    with torch.no_grad():
        torch.testing.assert_close(net(x), before)
    assert lora_layers(net)
