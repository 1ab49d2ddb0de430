"""QLoRA quantizes an MoE's stacked expert weights too (peft/quant_experts.py): each expert
on its own, within quant.py's error bounds; the stored codes take a quarter (NF4) or half
(int8) of bf16's bytes; counts are of the weights they stand for; a training step trains
the adapters only; merging into them is refused, and the merged export is the dequantized
stacks plus the adapters."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers.hf_models import random_hf_causal_lm
from lmforge.config import LoraConfig, OptimConfig
from lmforge.models.hf import load_hf_model
from lmforge.peft import (LoraError, after_materialize, count_trainable, dequantize_base,
                          export_merged, is_quantized, load_adapter, merge_lora,
                          prepare_model_for_lora, save_adapter, trainable_summary)
from lmforge.peft.quant import NF4_LEVELS, quantized_bytes
from lmforge.peft.quant_experts import QuantizableExperts, QuantizedStack
from lmforge.train.optim import build_optimizer

QWEN = dict(moe_intermediate_size=24, num_experts=8, num_experts_per_tok=2, head_dim=24,
            num_hidden_layers=2)
STACKS = ("gate_up_proj", "down_proj")


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe")
    random_hf_causal_lm("qwen3_moe", seed=1, **QWEN).save_pretrained(path)
    return path


def _tokens(batch: int = 2, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, 102, (batch, seq), generator=torch.Generator().manual_seed(0))


def _model(path, fmt=None, targets="all-linear"):
    model = load_hf_model(path).eval()
    cfg = LoraConfig(enabled=True, rank=4, alpha=8.0, targets=targets, quantize=fmt)
    prepare_model_for_lora(model, cfg)
    torch.manual_seed(0)
    after_materialize(model, cfg)
    return model


def _experts(model):
    return [m for m in model.modules() if isinstance(m, QuantizableExperts)]


def _randomize(model, scale: float = 0.1) -> None:
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("lora_a", "lora_b")):
                p.copy_(torch.randn(p.shape, generator=g) * scale)


def test_each_expert_is_quantized_on_its_own_within_quant_bounds():
    torch.manual_seed(0)
    stack = torch.randn(4, 50, 176)  # 8800 values an expert: 137.5 blocks, the last padded
    nf4 = QuantizedStack.from_weight(stack, "nf4")
    assert nf4.weight_nf4.shape == (4, 138 * 64 // 2) and nf4.weight_nf4.dtype == torch.uint8
    alone = QuantizedStack.from_weight(stack[2:3], "nf4")
    assert torch.equal(alone.weight_nf4[0], nf4.weight_nf4[2])  # no block spans experts
    blocks = F.pad(stack.flatten(1), (0, 32)).view(4, -1, 64)
    err = F.pad((nf4.dequantize() - stack).flatten(1), (0, 32)).view(4, -1, 64)
    widest_gap = max(b - a for a, b in zip(NF4_LEVELS, NF4_LEVELS[1:]))
    assert (err.abs().amax(-1) <= blocks.abs().amax(-1) * widest_gap / 2 * 1.02 + 1e-7).all()
    int8 = QuantizedStack.from_weight(stack, "int8")
    step = stack.abs().amax(-1, keepdim=True) / 127  # per expert, per output row
    assert ((int8.dequantize() - stack).abs() <= step / 2 + 1e-7).all()


@pytest.mark.parametrize("fmt,share", [("nf4", 0.27), ("int8", 0.6)])
def test_qlora_stores_the_expert_stacks_quantized(base_dir, fmt, share):
    plain, model = _model(base_dir), _model(base_dir, fmt)
    experts = _experts(model)
    assert len(experts) == 2 and is_quantized(model)
    for module in experts:
        assert module.gate_up_proj is None and module.down_proj is None  # no 16-bit copy
        for name in STACKS:
            codes = module.quantized[name].weight_nf4 if fmt == "nf4" else (
                module.quantized[name].weight_int8)
            assert codes.dtype == (torch.uint8 if fmt == "nf4" else torch.int8)
            stack = module.quantized[name]
            stored = sum(t.numel() * t.element_size()
                         for t in stack.quantized_tensors().values())
            assert stored < share * stack.numel() * 2  # bf16's bytes (int8: fp32 scales per
            # row of 24 or 64 values)
    assert quantized_bytes(model) > 0
    assert count_trainable(model) == count_trainable(plain)
    assert trainable_summary(model) == trainable_summary(plain)


@torch.no_grad()
def test_the_quantized_experts_compute_close_to_the_plain_ones(base_dir):
    plain, model = _model(base_dir), _model(base_dir, "nf4")
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(3))
    for ours, theirs in zip(_experts(model), _experts(plain)):
        for name in STACKS:
            w = getattr(theirs, name)
            deq = ours.base_weight(name)
            assert deq.shape == w.shape and deq.dtype == w.dtype
            assert (deq - w).abs().mean() / w.abs().mean() < 0.12  # quant.py's NF4 bound
        indices = torch.randint(0, 8, (40, 2), generator=torch.Generator().manual_seed(4))
        weights = torch.full((40, 2), 0.5)
        for name in STACKS:  # the plain experts, given the rounded stacks: the same output
            getattr(theirs, name).copy_(ours.base_weight(name))
        torch.testing.assert_close(ours(x, indices, weights), theirs(x, indices, weights),
                                   rtol=1e-6, atol=1e-6)
    want = _model(base_dir)(_tokens())  # int8's rounding is fine enough for the logits
    assert (_model(base_dir, "int8")(_tokens()) - want).norm() / want.norm() < 0.08


def test_a_training_step_trains_only_the_adapters(base_dir):
    model = _model(base_dir, "nf4").train()
    codes = {n: p.clone() for n, p in model.named_parameters() if not p.is_floating_point()}
    assert any(".experts.quantized." in n for n in codes)
    lora = {n: p.clone() for n, p in model.named_parameters() if n.endswith("lora_b")}
    optimizer = build_optimizer(model, OptimConfig(lr=1e-2, weight_decay=0.0))
    x = _tokens(batch=4, seq=24)
    loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
    loss.backward()
    for name, p in model.named_parameters():
        trains = name.endswith(("lora_a", "lora_b"))
        assert p.requires_grad == trains and (p.grad is not None) == trains, name
    assert model.layers["1"].feed_forward.experts.lora["down_proj"].lora_b.grad.abs().sum() > 0
    optimizer.step()
    assert all(torch.equal(p, codes[n]) for n, p in model.named_parameters() if n in codes)
    assert all(not torch.equal(p, lora[n]) for n, p in model.named_parameters() if n in lora)


@torch.no_grad()
def test_merging_into_quantized_stacks_is_refused_then_done_through_dequantization(base_dir):
    model = _model(base_dir, "nf4")
    _randomize(model)
    qlora = model(_tokens())
    with pytest.raises(LoraError, match="nf4-quantized expert stacks; dequantize them"):
        merge_lora(model)
    assert _experts(model)[0].lora  # nothing was merged
    dequantize_base(model, torch.float32)
    assert not is_quantized(model)
    torch.testing.assert_close(model(_tokens()), qlora, rtol=1e-5, atol=1e-5)
    merge_lora(model)
    torch.testing.assert_close(model(_tokens()), qlora, rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_the_merged_export_is_the_dequantized_stacks_plus_the_adapters(base_dir, tmp_path):
    model = _model(base_dir, "nf4")
    _randomize(model)
    qlora = model(_tokens())
    export_merged(model, tmp_path / "merged", dtype=torch.float32)
    assert is_quantized(model)  # the model itself is untouched
    merged = load_hf_model(tmp_path / "merged").eval()
    ours = model.layers["0"].feed_forward.experts
    for name in STACKS:
        want = ours.base_weight(name, torch.float32) + ours.lora[name].delta()
        torch.testing.assert_close(getattr(merged.layers["0"].feed_forward.experts, name),
                                   want, rtol=0, atol=0)
    torch.testing.assert_close(merged(_tokens()), qlora, rtol=1e-4, atol=1e-4)
    export_merged(model, tmp_path / "bf16")  # a quantized base's default: bf16
    assert load_hf_model(tmp_path / "bf16").layers["1"].feed_forward.experts.down_proj.dtype \
        == torch.bfloat16


@torch.no_grad()
def test_an_experts_adapter_loads_onto_quantized_experts(base_dir, tmp_path):
    """lora.adapter_from under QLoRA: the experts were quantized without adapters."""
    source = _model(base_dir)
    _randomize(source)
    adapter = save_adapter(source, tmp_path / "adapter")
    model = _model(base_dir, "int8", targets="attention")
    assert not any(hasattr(m, "lora") for m in _experts(model))
    load_adapter(model, adapter)
    experts = model.layers["0"].feed_forward.experts
    assert experts.quantized_format() == "int8" and set(experts.lora) == set(STACKS)
    qlora = model(_tokens())
    dequantize_base(model, torch.float32)
    reference = load_hf_model(base_dir).eval()
    reference.load_state_dict(model.state_dict(), strict=False)  # the rounded base
    load_adapter(reference, adapter)
    torch.testing.assert_close(reference(_tokens()), qlora, rtol=1e-5, atol=1e-5)
