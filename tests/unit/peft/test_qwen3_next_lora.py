"""LoRA on Qwen3-Next's Gated DeltaNet input projections, which its files and transformers'
model fuse per key head (in_proj_qkvz, in_proj_ba) where lmforge keeps Qwen3.5's four
apart: the fused names peft's users write mean both parts; all-linear adapts the linear
layers peft's all-linear adapts (less the shared expert's gate, and the router among its
parameters: lmforge adapts neither on any MoE family); our adapters cross to peft as one
adapter on each fused layer, with our logits, and merge; peft's come back apart with its
logits; and an adapter we wrote resumes training bit for bit."""
from __future__ import annotations

import json

import pytest
import torch

from helpers.hf_models import HYBRID_MOE_CONFIGS, random_hf_causal_lm, saved_hybrid_moe
from helpers.hf_parity import assert_lora_round_trip, tokens
from lmforge.config import ConfigError, LoraConfig
from lmforge.models.hf import load_hf_model
from lmforge.models.registry import PRESETS, family_of
from lmforge.peft import adapter_state_dict, apply_lora, load_adapter, save_adapter
from lmforge.peft.adapter_spec import AdapterError
from lmforge.peft.lora import lora_layers
from lmforge.peft.targets import resolve_targets

peft = pytest.importorskip("peft")
PARTS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
CONFIG = HYBRID_MOE_CONFIGS["qwen3_next"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return saved_hybrid_moe(tmp_path_factory.mktemp("qwen3_next"), "qwen3_next")


def _with_lora(path, targets, rank: int = 4):
    """Our model from ``path`` with adapters on ``targets``, their weights random (a
    fresh adapter's B is zero)."""
    model = load_hf_model(path).eval()
    apply_lora(model, LoraConfig(enabled=True, rank=rank, alpha=2.0 * rank, targets=targets))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("lora_a", "lora_b")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model


def _peft_modules(keys) -> set[str]:
    """The modules an adapter's tensors adapt, by transformers' names."""
    return {key.removeprefix("base_model.model.").split(".lora_")[0] for key in keys}


def test_the_fused_names_mean_both_parts():
    projections = family_of(PRESETS["qwen3-next-debug"]).projections
    assert resolve_targets("all-linear", projections) == (
        "q_proj", "k_proj", "v_proj", "o_proj", *PARTS, "out_proj",
        "experts.gate_up_proj", "experts.down_proj")
    assert resolve_targets(["linear_attn.in_proj_qkvz", "IN_PROJ_BA"], projections) == PARTS
    with pytest.raises(ConfigError, match=r"unknown module 'in_proj_qkvz'"):
        resolve_targets("in_proj_qkvz", family_of(PRESETS["qwen3.5-moe-debug"]).projections)


@torch.no_grad()
def test_all_linear_adapts_the_linear_layers_peft_adapts(hf_dir):
    """peft 0.21's all-linear on Qwen3NextForCausalLM: every nn.Linear but the head, and
    (its transformers-4 names mapped onto transformers 5's MoE) the experts' stacks and
    the router; the dense layer's MLP and the shared expert's take none."""
    hf_model, path = hf_dir
    ours = adapter_state_dict(_with_lora(path, "all-linear"))
    wrapped = peft.get_peft_model(random_hf_causal_lm("qwen3_next", **CONFIG),
                                  peft.LoraConfig(r=4, target_modules="all-linear"))
    theirs = {name.removeprefix("base_model.model.") for name, module in
              wrapped.named_modules() if isinstance(module, peft.tuners.lora.Linear)}
    assert {m for m in _peft_modules(ours) if ".experts" not in m} == {
        m for m in theirs if not m.endswith("shared_expert_gate")}
    assert sum(m.endswith(("in_proj_qkvz", "in_proj_ba")) for m in theirs) == 2 * 2
    assert set(wrapped.peft_config["default"].target_parameters) == {
        "gate_up_proj", "down_proj", "gate.weight"}


def test_all_linear_adapter_loads_in_peft_with_our_logits_and_merges(hf_dir, tmp_path):
    """One adapter of rank 8 (alpha 16: the parts' scaling) on each fused layer, beside
    the attention's and the experts'; to 1e-5 of the logits' scale (measured 5.1e-6), the
    merged export to 1e-4 (measured 1.4e-5)."""
    hf_model, path = hf_dir
    x = tokens(hf_model.config.vocab_size, 24)
    scale = hf_model(x).logits.abs().max().item()
    adapted = assert_lora_round_trip(hf_model, path, tmp_path, x, tolerance=1e-5 * scale,
                                     merged_tolerance=1e-4 * scale)
    assert {name for name in adapted if ".attention.in_proj_" in name} == {
        f"layers.{i}.attention.{p}" for i in (1, 2) for p in PARTS}
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert {"in_proj_qkvz", "in_proj_ba"} <= set(config["target_modules"])
    assert not {"in_proj_qkv", "in_proj_z"} & set(config["target_modules"])
    fused = [f"model.layers.{i}.linear_attn.{p}" for i in (1, 2)
             for p in ("in_proj_qkvz", "in_proj_ba")]
    assert (config["r"], config["lora_alpha"]) == (4, 8.0)
    assert config["rank_pattern"] == dict.fromkeys(fused, 8)
    assert config["alpha_pattern"] == dict.fromkeys(fused, 16.0)


@pytest.mark.long  # (a round trip each)
@pytest.mark.parametrize("targets", [["in_proj_qkvz", "in_proj_ba"], ["in_proj_qkv"]],
                         ids=["fused", "one-part"])
def test_the_fused_layers_alone_load_in_peft_and_merge(hf_dir, tmp_path, targets):
    """Both parts, or one (the other's rows of B zero); to 5e-5 of the logits' scale
    (measured 2.7e-5 and 8.1e-6: with only the Gated DeltaNet adapted this much, its
    summation order shows; transformers' own merged model is 1.4e-5 off its peft model,
    and in float64 peft's merge of the fused adapter gives our logits exactly), the
    merged export to 1e-4 (measured 1.4e-5, 2.8e-6)."""
    hf_model, path = hf_dir
    x = tokens(hf_model.config.vocab_size, 24)
    scale = hf_model(x).logits.abs().max().item()
    adapted = assert_lora_round_trip(hf_model, path, tmp_path, x, targets,
                                     tolerance=5e-5 * scale, merged_tolerance=1e-4 * scale)
    assert {name.rsplit(".", 1)[-1] for name in adapted} == (
        set(PARTS) if len(targets) == 2 else {"in_proj_qkv"})
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_modules"] == sorted({"in_proj_qkvz", "in_proj_ba"} & {
        "in_proj_qkvz" if t == "in_proj_qkv" else t for t in targets})


@torch.no_grad()
def test_peft_adapter_on_the_fused_layers_loads_into_ours_apart(hf_dir, tmp_path):
    """peft's adapter (random, rank 4) on in_proj_qkvz and in_proj_ba: each part takes the
    whole A and its rows of B (rank 4 each), with peft's logits (to 1e-5 of their scale;
    measured 2.0e-6); a
    model already holding LoRA of rank 2 on each part (training resumed) cannot take it
    exactly and refuses it in one line."""
    hf_model, path = hf_dir
    wrapped = peft.get_peft_model(hf_model, peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["in_proj_qkvz", "in_proj_ba"],
        init_lora_weights=False))
    x = tokens(hf_model.config.vocab_size, 24)
    want = wrapped(x).logits
    wrapped.save_pretrained(tmp_path / "adapter")
    wrapped.unload()
    ours = load_hf_model(path).eval()
    settings = load_adapter(ours, tmp_path / "adapter")
    assert {name: layer.rank for name, layer in lora_layers(ours).items()} == {
        f"layers.{i}.attention.{p}": 4 for i in (1, 2) for p in PARTS}
    assert sorted(settings.targets) == sorted(PARTS)
    assert (ours(x) - want).abs().max() <= 1e-5 * want.abs().max()
    held = _with_lora(path, ["in_proj_qkvz", "in_proj_ba"], rank=2)
    with pytest.raises(AdapterError, match=r"in_proj_qkvz does not split exactly into the "
                                           r"model's LoRA layers") as refused:
        load_adapter(held, tmp_path / "adapter")
    assert "\n" not in str(refused.value)


@torch.no_grad()
def test_our_adapter_resumes_bit_for_bit_and_loads_into_the_base(hf_dir, tmp_path):
    """Into a model with the same LoRA (as lora.adapter_from resumes training) each part
    takes back its own A and B exactly; into the base model, the parts take the fused
    adapter whole, with the same logits."""
    _, path = hf_dir
    ours = _with_lora(path, ["in_proj_qkvz", "in_proj_ba", "out_proj"])
    save_adapter(ours, tmp_path / "adapter")
    resumed = _with_lora(path, ["in_proj_qkvz", "in_proj_ba", "out_proj"])
    load_adapter(resumed, tmp_path / "adapter")
    want = {k: v for k, v in ours.state_dict().items() if k.endswith(("lora_a", "lora_b"))}
    got = {k: v for k, v in resumed.state_dict().items() if k.endswith(("lora_a", "lora_b"))}
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    base = load_hf_model(path).eval()
    load_adapter(base, tmp_path / "adapter")
    x = tokens(base.args.vocab_size, 24)
    torch.testing.assert_close(base(x), ours(x), rtol=1e-6, atol=1e-6)
