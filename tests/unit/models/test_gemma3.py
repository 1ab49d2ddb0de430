"""Gemma 3 (text) loads from a transformers directory with equal logits and greedy
decodes past its sliding window, with sliding and global layers interleaved by the
pattern or by an explicit layer_types list; exports back bit-identical; takes LoRA
adapters that peft loads; refuses what it does not compute, naming the field."""
from __future__ import annotations

import json

import pytest
import torch

from lmforge.config import ConfigError
from lmforge.models.common import count_parameters
from lmforge.models.hf import HFCheckpointError, load_hf_model
from lmforge.models.presets import PRESETS, check_model_args
from lmforge.models.registry import build_model
from helpers.hf_models import random_hf_causal_lm
from helpers.hf_parity import (assert_export_round_trip, assert_greedy_decode_equal,
                               assert_logits_equal, assert_lora_round_trip, tokens)

SEQ = 24
TINY = dict(hidden_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=20, intermediate_size=88, vocab_size=101, sliding_window=6,
            query_pre_attn_scalar=18, rope_theta=50_000.0, rope_local_base_freq=500.0)
CASES = {  # id -> Gemma3TextConfig fields beyond TINY
    "pattern2-tied": dict(sliding_window_pattern=2),
    "layer-types-linear-untied": dict(
        layer_types=["full_attention", "sliding_attention", "sliding_attention",
                     "full_attention"], rope_scaling={"rope_type": "linear", "factor": 4.0},
        tie_word_embeddings=False),
}


def _hf_model(case: str, seed: int = 4):
    return random_hf_causal_lm("gemma3_text", seed=seed, **(TINY | CASES[case]))


@pytest.fixture(params=sorted(CASES), scope="module")
def hf_dir(request, tmp_path_factory):
    model = _hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return model, path


def _tokens(vocab: int, seq: int = SEQ) -> torch.Tensor:
    return tokens(vocab, seq)


def test_layer_kinds_follow_the_config(hf_dir):
    hf_model, path = hf_dir
    kinds = load_hf_model(path).args.attention_kinds
    expected = tuple("sliding" if t == "sliding_attention" else "global"
                     for t in hf_model.config.layer_types)
    assert kinds == expected and {"sliding", "global"} <= set(kinds)


def test_logits_equal_transformers_past_the_window(hf_dir):
    hf_model, path = hf_dir
    assert_logits_equal(hf_model, path, _tokens(hf_model.config.vocab_size))


def test_greedy_decode_equals_transformers(hf_dir):
    hf_model, path = hf_dir
    prompt = _tokens(hf_model.config.vocab_size, 5)[0].tolist()
    assert_greedy_decode_equal(hf_model, path, prompt, 12)  # 17 tokens > window 6


def test_export_is_bit_identical_and_loads_in_transformers(hf_dir, tmp_path):
    hf_model, path = hf_dir
    after = assert_export_round_trip(hf_model, path, tmp_path / "out",
                                     _tokens(hf_model.config.vocab_size))
    assert after["layer_types"] == hf_model.config.layer_types


def test_lora_adapter_loads_in_peft_and_the_merged_export_agrees(hf_dir, tmp_path):
    hf_model, path = hf_dir
    assert_lora_round_trip(hf_model, path, tmp_path, _tokens(hf_model.config.vocab_size))


@pytest.mark.parametrize("field,value", [("final_logit_softcapping", 30.0),
                                         ("attn_logit_softcapping", 50.0),
                                         ("hidden_activation", "silu")])
def test_what_the_model_does_not_compute_is_refused_naming_the_field(tmp_path, field, value):
    _hf_model("pattern2-tied").save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg[field] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HFCheckpointError, match=field):
        load_hf_model(tmp_path)


def test_gemma3_1b_preset_has_the_published_parameter_count():
    """999,885,952: google/gemma-3-1b's safetensors, the embedding counted once (tied)."""
    assert count_parameters(build_model(PRESETS["gemma3-1b"])) == 999_885_952


@pytest.mark.parametrize("preset", ["gemma3-1b", "gemma3-4b", "gemma3-12b", "gemma3-27b"])
def test_presets_match_transformers_parameter_count(preset):
    import transformers
    from lmforge.models.registry import hf_config_from_args

    args = PRESETS[preset]
    check_model_args(args)
    fields = {k: v for k, v in hf_config_from_args(args).items()
              if k not in ("architectures", "model_type", "torch_dtype")}
    with torch.device("meta"):
        reference = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**fields))
    assert count_parameters(build_model(args)) == sum(p.numel() for p in reference.parameters())


def test_a_layer_count_the_layer_types_do_not_cover_is_refused_naming_the_field():
    import dataclasses
    args = dataclasses.replace(PRESETS["gemma3-1b"], layer_types=("sliding", "global"))
    with pytest.raises(ConfigError, match="model.n_layers"):
        check_model_args(args)
