"""LoRA on Qwen3.5-MoE (models/qwen3_5_moe: Qwen3.5's hybrid layers, separate in the files,
with a mixture of experts and a gated shared expert): all-linear adapts the attention's and
the Gated DeltaNet's linear layers, as peft's all-linear on Qwen3_5MoeForCausalLM does, and
the experts' stacks (peft's target_parameters), which that cannot reach, in place of the
shared expert's MLP and gate (lmforge's rule on every MoE family); peft loads our adapter
on transformers' model with our logits and the merged export agrees; peft's own adapter on
both loads into ours with its logits."""
from __future__ import annotations

import json

import pytest
import torch

from helpers.hf_models import HYBRID_MOE_CONFIGS, random_hf_causal_lm, saved_hybrid_moe
from helpers.hf_parity import assert_lora_round_trip, tokens
from lmforge.models.hf import hf_names, load_hf_model, read_model_args
from lmforge.peft import load_adapter
from lmforge.peft.expert_lora import LoraGroupedExperts
from lmforge.peft.lora import lora_layers

peft = pytest.importorskip("peft")
LINEAR_ATTENTION = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]
CONFIG = HYBRID_MOE_CONFIGS["qwen3_5_moe_text"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return saved_hybrid_moe(tmp_path_factory.mktemp("qwen3_5_moe"), "qwen3_5_moe_text")


def test_all_linear_adapts_both_attentions_and_the_experts_and_loads_in_peft(hf_dir,
                                                                             tmp_path):
    """To 1e-5 of the logits' scale (measured 1.8e-6), the merged export to 1e-4 (measured
    8.9e-6). The linear layers adapted are those peft's all-linear adapts on transformers'
    model but the shared expert's."""
    hf_model, path = hf_dir
    x = tokens(hf_model.config.vocab_size, 24)
    scale = hf_model(x).logits.abs().max().item()
    adapted = assert_lora_round_trip(hf_model, path, tmp_path, x, tolerance=1e-5 * scale,
                                     merged_tolerance=1e-4 * scale)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_modules"] == sorted(["q_proj", "k_proj", "v_proj", "o_proj",
                                               *LINEAR_ATTENTION])
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    wrapped = peft.get_peft_model(random_hf_causal_lm("qwen3_5_moe_text", **CONFIG),
                                  peft.LoraConfig(r=4, target_modules="all-linear"))
    theirs = {name.removeprefix("base_model.model.") for name, module in
              wrapped.named_modules() if isinstance(module, peft.tuners.lora.Linear)}
    names = hf_names(read_model_args(path))
    assert {names[f"{name}.weight"].removesuffix(".weight") for name in adapted} == {
        name for name in theirs if ".mlp.shared_expert" not in name}


@torch.no_grad()
def test_peft_adapter_on_the_linear_attention_and_the_experts_loads_into_ours(hf_dir,
                                                                             tmp_path):
    """peft's adapter (random, rank 4, alpha 8) on the DeltaNet's projections and the
    experts' stacks: our load_adapter gives peft's logits (to 1e-5 of their scale;
    measured 5.2e-6)."""
    hf_model, path = hf_dir
    wrapped = peft.get_peft_model(hf_model, peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=LINEAR_ATTENTION, init_lora_weights=False,
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    x = tokens(hf_model.config.vocab_size, 24)
    want = wrapped(x).logits
    wrapped.save_pretrained(tmp_path / "adapter")
    wrapped.unload()
    ours = load_hf_model(path).eval()
    load_adapter(ours, tmp_path / "adapter")
    assert len(lora_layers(ours)) == 3 * len(LINEAR_ATTENTION)
    assert sum(isinstance(m, LoraGroupedExperts) for m in ours.modules()) == 4
    assert (ours(x) - want).abs().max() <= 1e-5 * want.abs().max()
