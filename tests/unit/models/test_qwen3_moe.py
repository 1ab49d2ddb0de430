"""Qwen3-MoE (models/qwen3_moe) against transformers' own on tiny random models: equal
logits, equal greedy decodes alone and in a batch, an export whose files hold the same
per-expert tensors and that transformers loads with equal logits; dense layers among the
sparse ones (mlp_only_layers, decoder_sparse_step); bad checkpoints and configs refused in
one line naming the tensor or field."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.hf_models import random_hf_causal_lm
from helpers.hf_parity import (assert_export_round_trip, assert_greedy_decode_equal,
                               assert_logits_equal, assert_lora_round_trip, tokens)
from lmforge.config import ConfigError
from lmforge.models.hf import HFCheckpointError, load_hf_model, read_model_args
from lmforge.models.presets import check_model_args
from lmforge.models.registry import PRESETS

MOE = dict(moe_intermediate_size=24, num_experts=8, num_experts_per_tok=2, head_dim=24)
CASES = {  # id -> config fields
    "all-sparse-renormalised": dict(MOE, norm_topk_prob=True),
    # layer 0 dense by mlp_only_layers, layer 2 by decoder_sparse_step 2 (layer 1, 3 sparse)
    "dense-layers-raw-weights": dict(MOE, num_hidden_layers=4, mlp_only_layers=[0],
                                     decoder_sparse_step=2, norm_topk_prob=False,
                                     tie_word_embeddings=True),
}


@pytest.fixture(params=sorted(CASES), scope="module")
def hf_dir(request, tmp_path_factory):
    model = random_hf_causal_lm("qwen3_moe", seed=1, **CASES[request.param])
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return model, path


def test_logits_equal_transformers(hf_dir):
    hf_model, path = hf_dir
    assert_logits_equal(hf_model, path, tokens(hf_model.config.vocab_size, 24))


def test_greedy_decode_equals_transformers_alone_and_in_a_batch(hf_dir):
    hf_model, path = hf_dir
    prompt = tokens(hf_model.config.vocab_size, 6)[0].tolist()
    assert_greedy_decode_equal(hf_model, path, prompt, 12)


def test_export_keeps_the_per_expert_tensors_and_loads_in_transformers(hf_dir, tmp_path):
    hf_model, path = hf_dir
    after = assert_export_round_trip(
        hf_model, path, tmp_path / "out", tokens(hf_model.config.vocab_size, 24),
        keys=("model_type", "architectures", "tie_word_embeddings", "num_local_experts",
              "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
              "head_dim", "intermediate_size"))
    assert any(".mlp.experts.7.down_proj.weight" in k for k in load_file(
        tmp_path / "out" / "model.safetensors"))
    assert read_model_args(tmp_path / "out") == read_model_args(path)
    assert after["num_hidden_layers"] == hf_model.config.num_hidden_layers


@pytest.mark.parametrize("targets", ["all-linear", ["experts"], ["down_proj"]],
                         ids=["all-linear", "experts-only", "down_proj"])
def test_lora_on_the_experts_loads_in_peft_and_the_merged_export_agrees(hf_dir, tmp_path,
                                                                        targets):
    """peft loads the adapter (target_parameters for the stacked experts) on transformers'
    model with our logits; the merged export, loaded by transformers, gives them again.
    "down_proj" means the experts' down_proj, as peft reads it on an MoE model."""
    hf_model, path = hf_dir
    adapted = assert_lora_round_trip(hf_model, path, tmp_path,
                                     tokens(hf_model.config.vocab_size, 24), targets)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    want = (["mlp.experts.down_proj"] if targets == ["down_proj"] else
            ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    assert config["target_parameters"] == want
    # the linear layers' adapters: the attention's (a dense layer's MLP has none, as peft's)
    assert all(".attention." in n for n in adapted)
    assert bool(adapted) == (targets == "all-linear")


def test_dense_layers_follow_mlp_only_layers_and_decoder_sparse_step(tmp_path):
    random_hf_causal_lm("qwen3_moe", **CASES["dense-layers-raw-weights"]).save_pretrained(
        tmp_path)
    args = read_model_args(tmp_path)
    assert args.dense_layers == (0, 2) and args.sparse_layers == (1, 3)
    model = load_hf_model(tmp_path)
    assert [type(layer.feed_forward).__name__ for layer in model.layers.values()] == [
        "FeedForward", "MoE", "FeedForward", "MoE"]


def test_presets_have_the_published_parameter_counts():
    from lmforge.models.common import count_parameters
    from lmforge.models.registry import build_model
    assert count_parameters(build_model(PRESETS["qwen3-30b-a3b"])) == 30_532_122_624
    assert count_parameters(build_model(PRESETS["qwen3-235b-a22b"])) == 235_093_634_560


def _saved(tmp_path, **config):
    random_hf_causal_lm("qwen3_moe", **{**MOE, **config}).save_pretrained(tmp_path)
    return tmp_path


def test_a_checkpoint_missing_an_expert_is_refused_naming_the_tensor(tmp_path):
    path = _saved(tmp_path)
    sd = load_file(path / "model.safetensors")
    del sd["model.layers.1.mlp.experts.7.up_proj.weight"]
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(HFCheckpointError,
                       match=r"model\.layers\.1\.mlp\.experts\.7\.up_proj\.weight: missing"):
        load_hf_model(path)


def test_a_misshaped_expert_is_refused_naming_the_tensor(tmp_path):
    path = _saved(tmp_path)
    sd = load_file(path / "model.safetensors")
    name = "model.layers.0.mlp.experts.5.down_proj.weight"
    sd[name] = sd[name][:, :-1].contiguous()
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(HFCheckpointError, match=rf"{name.replace('.', '[.]')}: shape"):
        load_hf_model(path)


def test_a_checkpoint_with_more_experts_than_its_config_is_refused(tmp_path):
    path = _saved(tmp_path)
    config = json.loads((path / "config.json").read_text())
    config.pop("num_local_experts", None)
    (path / "config.json").write_text(json.dumps(config | {"num_experts": 6}))
    with pytest.raises(HFCheckpointError, match=r"experts\.7: unexpected, with 6 experts"):
        load_hf_model(path)


@pytest.mark.parametrize("field, value, match", [
    ("router_jitter_noise", 0.1, "router_jitter_noise"),
    ("mlp_only_layers", [5], "mlp_only_layers"),
    ("num_experts_per_tok", 0, "num_experts_per_tok"),
])
def test_configs_it_cannot_compute_are_refused_naming_the_field(tmp_path, field, value, match):
    path = _saved(tmp_path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {field: value}))
    with pytest.raises(HFCheckpointError, match=match):
        read_model_args(path)


def test_a_top_k_above_the_expert_count_is_refused_naming_the_field():
    import dataclasses
    args = dataclasses.replace(PRESETS["qwen3-moe-debug"], top_k=17)
    with pytest.raises(ConfigError, match=r"model\.top_k: 17 .* 16 experts"):
        check_model_args(args)
