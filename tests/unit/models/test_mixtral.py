"""Mixtral (models/mixtral) against transformers' own on tiny random models: equal logits,
equal greedy decodes alone and in a batch, with and without a sliding window shorter than
the sequence; an export whose files hold the released checkpoints' names and tensors
(``block_sparse_moe.experts.{e}.w1/w3/w2``) bit for bit and that transformers loads with
equal logits; the presets' published sizes; bad checkpoints and configs refused in one
line naming the file's tensor or the field."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.hf_models import random_hf_causal_lm
from helpers.hf_parity import (assert_export_round_trip, assert_greedy_decode_equal,
                               assert_lora_round_trip,
                               assert_logits_equal, tokens)
from lmforge.models.hf import HFCheckpointError, load_hf_model, read_model_args
from lmforge.models.registry import (PRESETS, args_from_hf_config, family_of,
                                     hf_config_from_args)

MOE = dict(intermediate_size=24, num_local_experts=8, num_experts_per_tok=2)
CASES = {  # id -> config fields
    "full-attention": dict(MOE),
    # a window of 8 keys under sequences of 18 and 24 tokens; one head embedding and output
    "window-8-tied": dict(MOE, sliding_window=8, tie_word_embeddings=True),
}


@pytest.fixture(params=sorted(CASES), scope="module")
def hf_dir(request, tmp_path_factory):
    model = random_hf_causal_lm("mixtral", seed=1, **CASES[request.param])
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return model, path


def test_logits_equal_transformers(hf_dir):
    hf_model, path = hf_dir
    assert read_model_args(path).sliding_window == hf_model.config.sliding_window
    assert_logits_equal(hf_model, path, tokens(hf_model.config.vocab_size, 24))


def test_greedy_decode_equals_transformers_alone_and_in_a_batch(hf_dir):
    hf_model, path = hf_dir
    prompt = tokens(hf_model.config.vocab_size, 6)[0].tolist()
    assert_greedy_decode_equal(hf_model, path, prompt, 12)


def test_export_keeps_the_released_names_and_loads_in_transformers(hf_dir, tmp_path):
    hf_model, path = hf_dir
    assert_export_round_trip(
        hf_model, path, tmp_path / "out", tokens(hf_model.config.vocab_size, 24),
        keys=("model_type", "architectures", "tie_word_embeddings", "num_local_experts",
              "num_experts_per_tok", "intermediate_size", "sliding_window",
              "num_hidden_layers"))
    exported = load_file(tmp_path / "out" / "model.safetensors")
    assert "model.layers.1.block_sparse_moe.experts.7.w3.weight" in exported
    assert not any(".mlp." in k for k in exported)
    assert read_model_args(tmp_path / "out") == read_model_args(path)


def test_the_config_is_read_as_mixtral_always_renormalising():
    config = random_hf_causal_lm("mixtral", **MOE).config.to_dict()
    args = args_from_hf_config(config)
    assert family_of(args).name == "mixtral" and args.family == "mixtral"
    assert (args.n_experts, args.top_k, args.moe_ffn_dim) == (8, 2, 24)
    assert args.norm_topk_prob and args.dense_layers == () and args.sliding_window is None


def test_presets_have_the_published_parameter_counts_and_read_back_from_config_json():
    from lmforge.models.common import count_parameters
    from lmforge.models.registry import build_model
    # the counts transformers' MixtralForCausalLM has with the released config.json files
    assert count_parameters(build_model(PRESETS["mixtral-8x7b"])) == 46_702_792_704
    assert count_parameters(build_model(PRESETS["mixtral-8x22b"])) == 140_630_071_296
    for name in ("mixtral-debug", "mixtral-8x7b", "mixtral-8x22b"):
        assert args_from_hf_config(hf_config_from_args(PRESETS[name])) == PRESETS[name]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("saved")
    random_hf_causal_lm("mixtral", **MOE).save_pretrained(path)
    return path, load_file(path / "model.safetensors"), (path / "config.json").read_text()


def _edited(saved, tmp_path, drop=(), add=None, **config):
    """A copy of the saved model without the tensors ``drop``, with ``add``'s, and
    config.json's fields replaced by ``config``."""
    _, sd, config_text = saved
    sd = {k: v for k, v in sd.items() if k not in drop} | (add or {})
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(json.loads(config_text) | config))
    return tmp_path


def test_a_checkpoint_missing_an_expert_is_refused_naming_the_file_tensor(saved, tmp_path):
    path = _edited(saved, tmp_path,
                   drop=["model.layers.1.block_sparse_moe.experts.5.w3.weight"])
    with pytest.raises(HFCheckpointError, match=r"model\.layers\.1\.block_sparse_moe\."
                                                r"experts\.5\.w3\.weight: missing"):
        load_hf_model(path)


def test_a_misshaped_expert_is_refused_naming_the_file_tensor(saved, tmp_path):
    path = _edited(saved, tmp_path, add={
        "model.layers.0.block_sparse_moe.experts.2.w2.weight": torch.zeros(64, 23)})
    with pytest.raises(HFCheckpointError, match=r"layers\.0\.block_sparse_moe\.experts\.2\."
                                                r"w2\.weight: shape \(64, 23\) \(expected"):
        load_hf_model(path)


def test_experts_beyond_the_config_are_refused_as_unexpected_in_the_file_names(saved,
                                                                               tmp_path):
    path = _edited(saved, tmp_path, num_local_experts=6)
    with pytest.raises(HFCheckpointError,
                       match=r"model\.layers\.0\.block_sparse_moe\.experts\.6\.w1\.weight: "
                             r"unexpected, with 6 experts in the config"):
        load_hf_model(path)


@pytest.mark.parametrize("field, value", [("router_jitter_noise", 0.1),
                                          ("num_experts_per_tok", 0),
                                          ("num_local_experts", None)])
def test_configs_it_cannot_compute_are_refused_naming_the_field(saved, tmp_path, field,
                                                                value):
    path = _edited(saved, tmp_path, **{field: value})
    with pytest.raises(HFCheckpointError, match=field):
        read_model_args(path)


def test_lora_on_attention_and_experts_loads_in_peft_and_the_merged_export_agrees(
        hf_dir, tmp_path):
    """all-linear: the attention's linears and the experts' stacked weights (peft's
    target_parameters); peft loads the adapter on transformers' model with our logits."""
    hf_model, path = hf_dir
    assert_lora_round_trip(hf_model, path, tmp_path, tokens(hf_model.config.vocab_size, 24))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
