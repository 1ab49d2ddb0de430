"""LoRA and QLoRA on Qwen3.5's hybrid stack (models/qwen3_5): ``lora.targets`` reaches the
Gated DeltaNet layers' projections (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a,
out_proj), ``all-linear`` adapts exactly the linears peft's all-linear adapts on
transformers' Qwen3_5ForCausalLM, adapters cross between peft and us both ways with the
same logits, the merged export loads in transformers with them, and a QLoRA step
quantizes those projections too with a loss close to the 16-bit base's."""
from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F

from helpers.hf_models import random_hf_causal_lm
from helpers.hf_parity import assert_lora_round_trip, tokens
from lmforge.config import LoraConfig
from lmforge.models.common import materialize
from lmforge.models.hf import load_hf_model
from lmforge.models.registry import PRESETS, build_model, family_of
from lmforge.peft import after_materialize, load_adapter, prepare_model_for_lora
from lmforge.peft.lora import lora_layers
from lmforge.peft.quant import QuantizedLinear
from lmforge.peft.targets import resolve_targets

peft = pytest.importorskip("peft")
LINEAR_ATTENTION = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]
CONFIG = dict(head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_conv_kernel_dim=4,
              num_hidden_layers=4)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A random transformers Qwen3.5 (three linear layers, then a full one) on disk, its
    A_log and dt_bias moved off transformers' constants."""
    model = random_hf_causal_lm("qwen3_5_text", seed=1, **CONFIG)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                p.add_(0.1 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("qwen3_5")
    model.save_pretrained(path)
    return model.eval(), path


def _hf_module_names(model) -> set[str]:
    """Our adapted modules by transformers' names."""
    names = family_of(model.args).hf_names(model.args)
    return {names[f"{name}.weight"].removesuffix(".weight") for name in lora_layers(model)}


def test_targets_name_the_linear_attention_projections():
    projections = family_of(PRESETS["qwen3.5-debug"]).projections
    assert resolve_targets("all-linear", projections) == (
        "q_proj", "k_proj", "v_proj", "o_proj", *LINEAR_ATTENTION,
        "gate_proj", "up_proj", "down_proj")
    assert resolve_targets("attention", projections) == (
        "q_proj", "k_proj", "v_proj", "o_proj", *LINEAR_ATTENTION)
    assert resolve_targets(["linear_attn.in_proj_qkv", "out_proj"], projections) == (
        "in_proj_qkv", "out_proj")


def test_all_linear_adapts_what_peft_adapts_on_transformers_model(hf_dir):
    """Every nn.Linear but the head, in both kinds of layer (peft 0.21 on
    Qwen3_5ForCausalLM: the five DeltaNet projections, q/k/v/o, the MLP's three)."""
    hf_model, path = hf_dir
    ours = load_hf_model(path)
    prepare_model_for_lora(ours, LoraConfig(enabled=True, rank=4, targets="all-linear"))
    wrapped = peft.get_peft_model(random_hf_causal_lm("qwen3_5_text", **CONFIG),
                                  peft.LoraConfig(r=4, target_modules="all-linear"))
    theirs = {name.removeprefix("base_model.model.") for name, module in
              wrapped.named_modules() if hasattr(module, "lora_A") and module.lora_A}
    assert _hf_module_names(ours) == theirs
    assert sum(".linear_attn." in name for name in theirs) == 3 * len(LINEAR_ATTENTION)


@pytest.mark.parametrize("targets", ["all-linear", LINEAR_ATTENTION])
def test_our_adapter_loads_in_peft_with_our_logits_and_merges(hf_dir, tmp_path, targets):
    """Ours to 1e-5 of the logits' scale, relative and absolute (assert_close's rule;
    measured at most 7.9e-6 of the scale apart on all-linear, 1.3e-5 on the DeltaNet's
    alone: our chunked delta rule sums in another order, and transformers' own fp32
    logits are 2.4e-5 of the scale off its float64 ones here); the merged export to
    2e-4 of it (measured 5.9e-5, 8.7e-5: with adapters this large the DeltaNet is that
    sensitive to rounding; peft's own merge moves transformers' logits as far)."""
    hf_model, path = hf_dir
    x = tokens(hf_model.config.vocab_size, 70)  # (longer than a 64-token chunk)
    scale = hf_model(x).logits.abs().max().item()
    adapted = assert_lora_round_trip(hf_model, path, tmp_path, x, targets,
                                     tolerance=1e-5 * scale, merged_tolerance=2e-4 * scale)
    linear = {n for n in adapted if n.rsplit(".", 1)[-1] in LINEAR_ATTENTION}
    assert len(linear) == 3 * len(LINEAR_ATTENTION)
    assert (linear == set(adapted)) == (targets == LINEAR_ATTENTION)


@torch.no_grad()
def test_peft_adapter_on_the_linear_attention_loads_into_ours(hf_dir, tmp_path):
    """peft's own adapter (random, non-zero B) on the DeltaNet projections: our
    load_adapter checks it against the layers' shapes and gives peft's logits."""
    hf_model, path = hf_dir
    wrapped = peft.get_peft_model(hf_model, peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=LINEAR_ATTENTION, init_lora_weights=False))
    x = tokens(hf_model.config.vocab_size, 24)
    want = wrapped(x).logits
    wrapped.save_pretrained(tmp_path / "adapter")
    wrapped.unload()
    ours = load_hf_model(path).eval()
    load_adapter(ours, tmp_path / "adapter")
    assert sorted(n.rsplit(".", 1)[-1] for n in lora_layers(ours)) == sorted(
        LINEAR_ATTENTION * 3)
    assert (ours(x) - want).abs().max() <= 1e-5 * want.abs().max()


@functools.cache  # (the 16-bit step, once for both formats)
def _lora_step(quantize: str | None) -> tuple[float, float, int]:
    """One AdamW step of all-linear LoRA on qwen3.5-debug under bf16 autocast (the
    trainer's order: meta build, swap, materialise, quantize): the losses before and
    after, and how many linears are quantized."""
    args = dataclasses.replace(PRESETS["qwen3.5-debug"], vocab_size=97)
    cfg = LoraConfig(enabled=True, rank=8, alpha=16.0, targets="all-linear",
                     quantize=quantize)
    model = build_model(args)
    prepare_model_for_lora(model, cfg)
    torch.manual_seed(0)
    materialize(model, "cpu")
    after_materialize(model, cfg)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    x = tokens(args.vocab_size, 33, batch=4)
    losses = []
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses[0], losses[1], sum(isinstance(m, QuantizedLinear) for m in model.modules())


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_qlora_quantizes_the_linear_attention_and_steps_close_to_lora(fmt):
    """Every adapted linear (the DeltaNet's five in each of 3 layers, 4 + 3 in the full
    one, 3 in each MLP) holds a quantized base; both losses finite, falling, and within
    1e-3 of those over a 16-bit (autocast bf16) base (measured: nf4 1.7e-4, int8
    3.2e-6 relative)."""
    base = _lora_step(None)
    quantized = _lora_step(fmt)
    assert base[2] == 0 and quantized[2] == 3 * 5 + 4 + 4 * 3
    for got, want in zip(quantized[:2], base[:2]):
        assert torch.isfinite(torch.tensor(got)) and got == pytest.approx(want, rel=1e-3)
    assert quantized[1] < quantized[0]
