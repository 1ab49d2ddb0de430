"""A mixture of experts in `lmforge estimate` and `lmforge plan`: total and active
parameters (docs/estimate.md, "Mixture of experts"), what trains under LoRA on the
experts, and a layout search that keeps to the layouts the trainer runs an MoE with."""
import dataclasses

import pytest

from lmforge.config import load_config
from lmforge.models.qwen3_moe.presets import PRESETS
from lmforge.perf.estimate import describe_model, estimate_memory, format_table
from lmforge.perf.estimate_setup import setup_from_config
from lmforge.perf.flops import matmul_params
from lmforge.perf.layout_search import layouts, plan, plan_args
from lmforge.perf.timing import DEVICES, param_count
from lmforge.perf.weights import active_parameters, model_parameters

QWEN3_30B = PRESETS["qwen3-30b-a3b"]


def test_qwen3_30b_a3b_total_and_active_parameters():
    """Active: what one token's forward uses: embedding, attention (q/k norms included),
    norms, the router, top-8 of the 128 experts, the final norm and the head. Qwen's model
    card: 30.5B in all, 3.3B activated."""
    a = QWEN3_30B
    assert model_parameters(a) == 30_532_122_624
    attention = (a.dim * a.n_heads * a.head_dim * 2 + a.dim * a.n_kv_heads * a.head_dim * 2
                 + 2 * a.head_dim)
    experts = a.top_k * 3 * a.dim * a.moe_ffn_dim + a.dim * a.n_experts  # (and the router)
    per_layer = attention + experts + 2 * a.dim
    by_hand = 2 * a.vocab_size * a.dim + a.n_layers * per_layer + a.dim
    assert active_parameters(a) == by_hand == 3_353_032_704
    assert active_parameters(a) / 1e9 == pytest.approx(3.3, abs=0.06)


def test_estimate_names_total_and_active_parameters():
    line = describe_model(QWEN3_30B)
    assert "30,532,122,624 parameters (3,353,032,704 active: top 8 of 128 experts" in line
    dense = load_config(None, ["model.preset=debug"])
    assert "active" not in describe_model(setup_from_config(dense, device="cpu").args)


def test_estimate_of_an_moe_lora_config_trains_the_adapters_alone():
    overrides = ["model.preset=qwen3-moe-debug", "data.seq_len=64", "lora.enabled=true",
                 "lora.targets=all-linear"]
    setup = setup_from_config(load_config(None, overrides), device="cpu")
    assert [t for t, _ in setup.trainable.adapters][-2:] == ["experts.gate_up_proj",
                                                            "experts.down_proj"]
    est = estimate_memory(setup)
    assert est.as_dict()["active_parameters"] == active_parameters(setup.args)
    assert "active" in format_table(est)
    full = estimate_memory(setup_from_config(load_config(None, overrides[:2]), device="cpu"))
    assert est.components["optimizer states"] < 0.2 * full.components["optimizer states"]


def test_fsdp_gathers_every_expert_but_a_token_computes_with_the_active_ones():
    a = QWEN3_30B
    assert param_count(a) > 0.98 * model_parameters(a)
    assert matmul_params(a) < 0.11 * model_parameters(a)


@pytest.mark.parametrize("preset, gpus", [("qwen3-moe-debug", 4), ("qwen3-30b-a3b", 8)])
def test_plan_keeps_an_moe_to_data_parallel_layouts(preset, gpus):
    """The trainer refuses tp, pp and cp for an MoE (models.presets.check_layout_fits):
    the search does not enumerate them, so every layout it tries is one it may propose."""
    cfg = load_config(None, [f"model.preset={preset}", "data.seq_len=512",
                             "train.device=cuda"])
    tried = list(layouts(cfg, plan_args(cfg), gpus, 8))
    assert tried and all(k["parallel.tp"] == k["parallel.pp"] == k["parallel.cp"] == 1
                         for k in tried)
    result = plan(cfg, gpus, 8, dataclasses.replace(DEVICES["h100"], memory_gib=1e6))
    assert result.tried == len(tried) and result.candidates


@pytest.mark.parametrize("extra", [[], ["lora.enabled=true", "lora.targets=all-linear"],
                                   ["train.activation_checkpointing=full"]])
def test_gpt_oss_experts_in_every_layer_and_no_dense_mlp(extra):
    """gpt-oss has no dense MLP (Projections.mlp is empty): every block is walked as an
    MoE. OpenAI's active counts (3.6B, 5.1B) leave the embedding out; ours keep it."""
    from lmforge.models.registry import PRESETS as ALL

    setup = setup_from_config(load_config(None, ["model.preset=gpt-oss-debug",
                                                 "data.seq_len=64"] + extra), device="cuda")
    assert estimate_memory(setup).peak_bytes > 0
    a = ALL["gpt-oss-20b"]
    assert (active_parameters(a) - a.vocab_size * a.dim) / 1e9 == pytest.approx(3.6, abs=0.05)
