"""Every family loads from a transformers directory with equal logits and greedy decodes,
exports back bit-identical, and takes LoRA adapters that peft loads: Mistral, Qwen2/2.5
and Qwen3 (Llama with flags: sliding window, q/k/v biases, q/k norm, explicit head_dim)
and GPT-J (its own model: parallel block, partial interleaved rotary, biases)."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from lmforge.models.hf import HFCheckpointError, load_hf_model
from lmforge.config import ConfigError
from lmforge.models.common import count_parameters
from lmforge.models.attention import sliding_window_mask
from lmforge.models.presets import PRESETS, check_model_args
from lmforge.models.registry import build_model
from helpers.hf_models import random_hf_causal_lm, random_hf_gptj
from helpers.hf_parity import (assert_export_round_trip, assert_greedy_decode_equal,
                               assert_logits_equal, assert_lora_round_trip, tokens)

SEQ = 24
FAMILIES = {  # id -> (model_type, config fields beyond the tiny Llama shape)
    "mistral-window8": ("mistral", {"sliding_window": 8}),
    "qwen2-bias": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3-head_dim24": ("qwen3", {"head_dim": 24}),
    "qwen3-tied": ("qwen3", {"head_dim": 24, "tie_word_embeddings": True}),
    "gptj-rotary8": ("gptj", {}),
    "gptj-full-rotary": ("gptj", {"rotary_dim": 16, "vocab_size": 50400}),
}
# config.json fields that define the architecture, per model_type
_SHAPE_KEYS = {"gptj": ("n_embd", "n_layer", "n_head", "n_inner", "rotary_dim", "vocab_size",
                        "n_positions", "layer_norm_epsilon", "activation_function")}
_LLAMA_SHAPE_KEYS = ("sliding_window", "num_key_value_heads", "use_sliding_window")


def _random_model(model_type: str, **config):
    if model_type == "gptj":
        return random_hf_gptj(seed=1, **config)
    return random_hf_causal_lm(model_type, seed=1, **config)


@pytest.fixture(params=sorted(FAMILIES), scope="module")
def hf_dir(request, tmp_path_factory):
    model_type, config = FAMILIES[request.param]
    model = _random_model(model_type, **config)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return model, path


def _tokens(vocab: int, seq: int = SEQ) -> torch.Tensor:
    return tokens(vocab, seq)


def test_logits_equal_transformers(hf_dir):
    hf_model, path = hf_dir
    assert_logits_equal(hf_model, path, _tokens(hf_model.config.vocab_size))


def test_greedy_decode_equals_transformers(hf_dir):
    hf_model, path = hf_dir
    prompt = _tokens(hf_model.config.vocab_size, 6)[0].tolist()
    assert_greedy_decode_equal(hf_model, path, prompt, 14)  # 20 tokens > window 8


def test_export_is_bit_identical_and_loads_in_transformers(hf_dir, tmp_path):
    hf_model, path = hf_dir
    model_type = hf_model.config.model_type
    after = assert_export_round_trip(
        hf_model, path, tmp_path / "out", _tokens(hf_model.config.vocab_size),
        keys=("model_type", "architectures", "tie_word_embeddings",
              *_SHAPE_KEYS.get(model_type, _LLAMA_SHAPE_KEYS)))
    if model_type != "gptj":
        before = json.loads((path / "config.json").read_text())
        default_head_dim = before["hidden_size"] // before["num_attention_heads"]
        assert after["head_dim"] == before.get("head_dim", default_head_dim)


def test_lora_adapter_loads_in_peft_and_the_merged_export_agrees(hf_dir, tmp_path):
    """Adapters on every linear layer (biases and q/k norms stay frozen): peft
    loads ours on transformers' model with our logits, and the merged export, loaded by
    transformers, gives the same logits again."""
    hf_model, path = hf_dir
    assert_lora_round_trip(hf_model, path, tmp_path, _tokens(hf_model.config.vocab_size))


def test_unknown_model_type_is_refused_naming_config_json_and_model_type(tmp_path):
    random_hf_causal_lm("llama").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"model_type": "gpt2"}))
    with pytest.raises(HFCheckpointError, match=r"config\.json: model_type = 'gpt2'"):
        load_hf_model(tmp_path)


def test_qwen_per_layer_sliding_window_is_refused_naming_the_key(tmp_path):
    random_hf_causal_lm("qwen2", use_sliding_window=True, sliding_window=8,
                        max_window_layers=1).save_pretrained(tmp_path)
    with pytest.raises(HFCheckpointError, match="use_sliding_window"):
        load_hf_model(tmp_path)


def test_window_mask_counts_the_query_itself_and_is_skipped_when_it_cannot_bite():
    mask = sliding_window_mask(None, seq=5, past=0, window=3, device="cpu")
    assert mask[4].tolist() == [False, False, True, True, True]
    assert sliding_window_mask(None, seq=3, past=0, window=3, device="cpu") is None
    decode = sliding_window_mask(None, seq=1, past=4, window=3, device="cpu")
    assert decode.tolist() == [[False, False, True, True, True]]


# Published totals; Qwen3-1.7B ties its embeddings, so lm_head is not counted twice.
PUBLISHED_PARAMETERS = {
    "mistral-7b": 7_241_732_096, "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-1.5b": 1_543_714_304, "qwen2.5-7b": 7_615_616_512,
    "qwen3-0.6b": 596_049_920, "qwen3-1.7b": 1_720_574_976, "qwen3-8b": 8_190_735_360,
}


@pytest.mark.parametrize("preset", sorted(PUBLISHED_PARAMETERS))
def test_family_presets_have_the_published_parameter_counts(preset):
    assert count_parameters(build_model(PRESETS[preset])) == PUBLISHED_PARAMETERS[preset]


def test_gptj_6b_preset_is_transformers_gptj_and_the_model_cards_count_less_its_shard_copies():
    """EleutherAI's card says 6,053,381,344 parameters: mesh-transformer-jax's count, with
    a copy of each replicated tensor on each of its 8 model-parallel shards and a bias per
    shard on its one-hot embedding. transformers' GPTJForCausalLM, and so ours, holds each
    once (models/gptj/presets.py)."""
    import transformers
    args = PRESETS["gptj-6b"]
    ours = count_parameters(build_model(args))
    with torch.device("meta"):
        theirs = transformers.GPTJForCausalLM(transformers.GPTJConfig())  # GPT-J 6B's config
    assert ours == sum(p.numel() for p in theirs.parameters()) == 6_050_882_784
    shards, d, layers = 8, args.dim, args.n_layers
    replicated = layers * (2 * d + d) + 2 * d  # ln_1 weight+bias, fc_out bias; ln_f
    assert ours + (shards - 1) * replicated + shards * d == 6_053_381_344


def test_gptj_refuses_grouped_query_attention_and_an_odd_rotary_dim_naming_the_field():
    args = PRESETS["gptj-tiny"]
    with pytest.raises(ConfigError, match="model.n_kv_heads"):
        check_model_args(dataclasses.replace(args, n_kv_heads=2))
    with pytest.raises(ConfigError, match="model.rotary_dim"):
        check_model_args(dataclasses.replace(args, rotary_dim=7))


def test_gptj_checkpoint_buffers_of_old_transformers_are_ignored_and_other_keys_refused(
        tmp_path):
    """EleutherAI/gpt-j-6b's weights carry each layer's attn.bias / attn.masked_bias
    (causal-mask buffers of transformers < 4.30): loaded past; an unknown key is not."""
    from safetensors.torch import save_file
    model = random_hf_gptj(seed=3)
    model.save_pretrained(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    sd["transformer.h.0.attn.bias"] = torch.ones(1, 1, 8, 8, dtype=torch.bool)
    sd["transformer.h.0.attn.masked_bias"] = torch.tensor(-1e9)
    save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    tokens = _tokens(102)
    with torch.no_grad():
        torch.testing.assert_close(load_hf_model(tmp_path)(tokens), model(tokens).logits,
                                   rtol=1e-5, atol=1e-5)
    sd["transformer.h.0.attn.extra"] = torch.zeros(2)
    save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(HFCheckpointError, match="unexpected: transformer.h.0.attn.extra"):
        load_hf_model(tmp_path)


def _job(*overrides):
    from lmforge.config import load_config
    return load_config(None, list(overrides))


def test_model_family_makes_a_preset_another_variant_with_its_fixed_flags():
    from lmforge.models.presets import model_args
    qwen3 = model_args(_job("model.preset=debug", "model.family=qwen3", "model.head_dim=32"))
    assert (qwen3.family, qwen3.qk_norm, qwen3.attention_bias, qwen3.head_dim) == (
        "qwen3", True, False, 32)
    assert model_args(_job("model.preset=debug", "model.family=qwen2")).attention_bias
    mistral = model_args(_job("model.preset=debug", "model.family=mistral",
                              "model.sliding_window=16"))
    assert mistral.sliding_window == 16
    assert model_args(_job("model.preset=mistral-7b", "model.family=llama")).sliding_window \
        is None  # a llama config.json has no window: dropped, not silently exported wrong
    assert model_args(_job("model.preset=gptj-tiny", "model.rotary_dim=16")).rotary_dim == 16


@pytest.mark.parametrize("overrides, field", [
    (("model.preset=debug", "model.family=gptj"), "model.family"),
    (("model.preset=gptj-tiny", "model.family=llama"), "model.family"),
    (("model.preset=debug", "model.rotary_dim=8"), "model.rotary_dim"),
    (("model.preset=gptj-tiny", "model.head_dim=8"), "model.head_dim"),
    (("model.preset=debug", "model.sliding_window=8"), "model.sliding_window"),
])
def test_model_fields_another_family_owns_are_refused_naming_the_field(overrides, field):
    from lmforge.models.presets import validate_job
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        validate_job(_job(*overrides))
