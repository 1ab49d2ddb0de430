"""Qwen3-Next (models/qwen3_next: Qwen3.5's hybrid layers, a mixture of experts with a
gated shared expert) against transformers' Qwen3NextForCausalLM on a tiny random model:
equal logits, equal greedy decodes alone and left-padded in a batch, an export whose files
hold the original tensors (the fused in_proj_qkvz / in_proj_ba, one tensor per expert) and
that transformers loads with equal logits; layer_types and dense layers read as given; a
checkpoint missing a fused projection refused in one line naming it. Its adapters, peft's
and merged: tests/unit/peft/test_qwen3_next_lora.py."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.hf_models import saved_hybrid_moe
from helpers.hf_parity import (assert_export_round_trip, assert_greedy_decode_equal,
                               tokens)
from lmforge.models.common import count_parameters
from lmforge.models.hf import HFCheckpointError, load_hf_model, read_model_args
from lmforge.models.presets import check_model_args
from lmforge.models.registry import PRESETS, build_model


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return saved_hybrid_moe(tmp_path_factory.mktemp("qwen3_next"), "qwen3_next")


@torch.no_grad()
def test_logits_equal_transformers(hf_dir):
    """To 1e-5 of the logits' scale (about 3), over more than one 64-token chunk."""
    hf_model, path = hf_dir
    x = tokens(hf_model.config.vocab_size, 70)
    want, got = hf_model(x).logits, load_hf_model(path)(x)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_greedy_decode_equals_transformers_alone_and_in_a_batch(hf_dir):
    hf_model, path = hf_dir
    prompt = tokens(hf_model.config.vocab_size, 6)[0].tolist()
    assert_greedy_decode_equal(hf_model, path, prompt, 12)


def test_export_holds_the_fused_and_per_expert_tensors_and_loads_in_transformers(
        hf_dir, tmp_path):
    hf_model, path = hf_dir
    assert_export_round_trip(
        hf_model, path, tmp_path / "out", tokens(hf_model.config.vocab_size, 24),
        keys=("model_type", "architectures", "layer_types", "mlp_only_layers",
              "norm_topk_prob", "num_experts", "moe_intermediate_size",
              "shared_expert_intermediate_size", "intermediate_size", "head_dim"))
    names = load_file(tmp_path / "out" / "model.safetensors").keys()
    assert {"model.layers.1.linear_attn.in_proj_qkvz.weight",
            "model.layers.0.mlp.experts.7.down_proj.weight",
            "model.layers.0.mlp.shared_expert_gate.weight"} <= names
    assert read_model_args(tmp_path / "out") == read_model_args(path)


def test_layer_types_and_dense_layers_are_read_as_given(hf_dir):
    hf_model, path = hf_dir
    args = read_model_args(path)
    assert args.layer_types == tuple(hf_model.config.layer_types)
    assert args.dense_layers == (1,) and args.sparse_layers == (0, 2, 3)


def test_a_checkpoint_missing_a_fused_projection_is_refused_naming_it(hf_dir, tmp_path):
    _, path = hf_dir
    sd = load_file(path / "model.safetensors")
    del sd["model.layers.2.linear_attn.in_proj_ba.weight"]
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(HFCheckpointError, match=r"missing: model\.layers\.2\.linear_attn"
                                                r"\.in_proj_ba\.weight") as refused:
        load_hf_model(tmp_path)
    assert "\n" not in str(refused.value)


def test_presets_check_and_the_80b_has_80b_parameters():
    """79.7B: the released files' 81.3B less the multi-token-prediction layer, not built."""
    check_model_args(PRESETS["qwen3-next-debug"])
    check_model_args(PRESETS["qwen3-next-80b-a3b"])
    assert count_parameters(build_model(PRESETS["qwen3-next-80b-a3b"])) == 79_674_391_296
