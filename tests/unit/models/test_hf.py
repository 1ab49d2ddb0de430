"""Hugging Face checkpoint import and export against transformers' own Llama."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")
from transformers import LlamaForCausalLM  # noqa: E402

from helpers.hf_models import load_reference, random_hf_llama  # noqa: E402
from lmforge.data.tokenizer import train_bpe  # noqa: E402
from lmforge.models.common import new_caches  # noqa: E402
from lmforge.models.hf import (  # noqa: E402
    HFCheckpointError, args_from_hf_config, from_hf_state_dict, hf_config_from_args,
    load_hf_model, read_hf_state_dict, save_hf_model, to_hf_state_dict)

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
# head_dim 16: with original_max_position_embeddings 32 the Llama-3 scaling leaves some
# frequencies alone, interpolates some and divides the rest, so all three branches run.
VARIANTS = {
    "gqa_untied": dict(num_key_value_heads=2, tie_word_embeddings=False),
    "mha_tied": dict(num_key_value_heads=4, tie_word_embeddings=True),
    "gqa_tied_llama3_scaling": dict(num_key_value_heads=1, tie_word_embeddings=True,
                                    rope_theta=500000.0, rope_scaling=LLAMA3_SCALING),
    # a context extended as users extend it: a raised base and YaRN (the ramp between
    # beta_slow and beta_fast falls inside head_dim 16 at original length 32), or linear
    "gqa_raised_base_yarn": dict(
        num_key_value_heads=2, tie_word_embeddings=False, rope_theta=1e6, rope_scaling={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
    "gqa_yarn_explicit": dict(num_key_value_heads=2, tie_word_embeddings=False, rope_scaling={
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 48,
        "beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": 1.3, "truncate": False}),
    "gqa_linear": dict(num_key_value_heads=2, tie_word_embeddings=True,
                       rope_scaling={"rope_type": "linear", "factor": 2.0}),
}
VOCAB = 102  # not a multiple of 8; even, so Meta-style row shards split it in two


def make_hf_model(seed: int = 0, **overrides) -> LlamaForCausalLM:
    return random_hf_llama(seed, **{"vocab_size": VOCAB, **overrides})


def saved_hf_model(tmp_path: Path, name: str = "hf", **overrides):
    model = make_hf_model(**overrides)
    model.save_pretrained(tmp_path / name)
    return model, tmp_path / name


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def prompt(batch: int = 2, seq: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def greedy(model, tokens: torch.Tensor, new_tokens: int, use_cache: bool) -> torch.Tensor:
    caches = new_caches(model, tokens.shape[0], tokens.shape[1] + new_tokens) if use_cache else None
    logits = model(tokens, caches=caches)
    for _ in range(new_tokens):
        next_token = logits[:, -1].argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, next_token], dim=1)
        logits = model(next_token, caches=caches) if use_cache else model(tokens)
    return tokens


# ---------------------------------------------------------------------------- parity

@pytest.mark.parametrize("variant", VARIANTS)
@torch.no_grad()
def test_logits_match_transformers_within_1e5_relative(tmp_path, variant):
    reference, path = saved_hf_model(tmp_path, **VARIANTS[variant])
    model = load_hf_model(path)
    tokens = prompt()
    assert rel_err(model(tokens), reference(tokens).logits) <= 1e-5


@pytest.mark.parametrize("variant", VARIANTS)
@torch.no_grad()
def test_greedy_generation_matches_transformers_with_and_without_kv_cache(tmp_path, variant):
    reference, path = saved_hf_model(tmp_path, **VARIANTS[variant])
    model = load_hf_model(path)
    tokens = prompt(batch=1, seq=6)
    expected = reference.generate(tokens, max_new_tokens=20, do_sample=False)
    assert expected.shape[1] == 26
    assert torch.equal(greedy(model, tokens, 20, use_cache=True), expected)
    assert torch.equal(greedy(model, tokens, 20, use_cache=False), expected)


@torch.no_grad()
def test_loaded_tied_model_shares_one_embedding_parameter(tmp_path):
    _, path = saved_hf_model(tmp_path, tie_word_embeddings=True)
    model = load_hf_model(path)
    assert model.output.weight is model.tok_embeddings.weight


def test_load_keeps_stored_dtype_unless_told(tmp_path):
    reference, path = saved_hf_model(tmp_path)
    reference.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    assert load_hf_model(tmp_path / "bf16").tok_embeddings.weight.dtype == torch.bfloat16
    assert load_hf_model(path, dtype=torch.bfloat16).norm.weight.dtype == torch.bfloat16


# ------------------------------------------------------------------------ round trip

@pytest.mark.parametrize("variant", VARIANTS)
def test_config_round_trips_through_hf_config(tmp_path, variant):
    reference, path = saved_hf_model(tmp_path, **VARIANTS[variant])
    config = json.loads((path / "config.json").read_text())
    args = args_from_hf_config(config)
    assert args_from_hf_config(hf_config_from_args(args)) == args
    assert args.vocab_size == VOCAB and args.n_kv_heads == VARIANTS[variant]["num_key_value_heads"]
    assert args.tie_embeddings == VARIANTS[variant]["tie_word_embeddings"]
    assert (args.rope_scaling is not None) == ("rope_scaling" in VARIANTS[variant])


def test_config_reads_transformers4_top_level_rope_fields():
    args = args_from_hf_config({
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "vocab_size": 10, "intermediate_size": 96,
        "rope_theta": 500000.0, "rope_scaling": LLAMA3_SCALING})
    assert args.rope_theta == 500000.0 and args.rope_scaling.factor == 8.0
    assert args.n_kv_heads == 4 and not args.tie_embeddings


@pytest.mark.parametrize("field,value", [("model_type", "gpt2"), ("hidden_act", "gelu"),
                                         ("attention_bias", True), ("mlp_bias", True)])
def test_config_refuses_unsupported_fields_naming_them(field, value):
    config = hf_config_from_args(args_from_hf_config(make_hf_model().config.to_dict()))
    config[field] = value
    with pytest.raises(ValueError, match=field):
        args_from_hf_config(config)


def test_config_refuses_a_rope_scaling_it_does_not_compute():
    config = make_hf_model().config.to_dict()
    config["rope_parameters"] = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4}
    with pytest.raises(ValueError, match="rope_parameters.rope_type = 'dynamic' is not "
                                         "supported"):
        args_from_hf_config(config)
    config["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                 "mscale": 0.7, "mscale_all_dim": 0.7}
    with pytest.raises(ValueError, match="rope_parameters.mscale"):
        args_from_hf_config(config)


@pytest.mark.parametrize("variant", VARIANTS)
def test_state_dict_mapping_round_trips_bit_identically(tmp_path, variant):
    _, path = saved_hf_model(tmp_path, **VARIANTS[variant])
    hf_sd = read_hf_state_dict(path)
    args = args_from_hf_config(json.loads((path / "config.json").read_text()))
    back = to_hf_state_dict(from_hf_state_dict(hf_sd, args), args)
    assert back.keys() == hf_sd.keys()
    assert all(torch.equal(back[k], hf_sd[k]) for k in hf_sd)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("max_shard_bytes", [5 * 1000**3, 40_000], ids=["single", "sharded"])
@torch.no_grad()
def test_save_round_trips_every_tensor_and_transformers_reloads_it(tmp_path, variant,
                                                                    max_shard_bytes):
    reference, path = saved_hf_model(tmp_path, **VARIANTS[variant])
    out = save_hf_model(load_hf_model(path), tmp_path / "out", max_shard_bytes=max_shard_bytes)
    sharded = (out / "model.safetensors.index.json").is_file()
    assert sharded == (max_shard_bytes < 1000**3)
    if sharded:
        assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    original, saved = read_hf_state_dict(path), read_hf_state_dict(out)
    assert saved.keys() == original.keys()
    for key in original:
        assert saved[key].dtype == original[key].dtype and torch.equal(saved[key], original[key])
    reloaded = load_reference(out)
    tokens = prompt()
    assert torch.equal(reloaded(tokens).logits, reference(tokens).logits)


def test_save_stores_tied_embedding_once(tmp_path):
    _, path = saved_hf_model(tmp_path, tie_word_embeddings=True)
    out = save_hf_model(load_hf_model(path), tmp_path / "out")
    keys = load_file(out / "model.safetensors").keys()
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys


def test_save_writes_tokenizer_generation_config_and_casts_dtype(tmp_path):
    _, path = saved_hf_model(tmp_path)
    tokenizer = train_bpe(["hello world, hello lmforge"] * 20, vocab_size=300)
    out = save_hf_model(load_hf_model(path), tmp_path / "out", tokenizer=tokenizer,
                        dtype=torch.bfloat16, generation_config={"max_new_tokens": 7})
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation == {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id,
                          "max_new_tokens": 7}
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["eos_token_id"] == tokenizer.eos_id
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
    assert all(t.dtype == torch.bfloat16 for t in read_hf_state_dict(out).values())


def test_save_replaces_a_model_dir_atomically_and_leaves_no_temp_dirs(tmp_path):
    _, path = saved_hf_model(tmp_path)
    model = load_hf_model(path)
    out = tmp_path / "export" / "hf"
    save_hf_model(model, out, max_shard_bytes=40_000)
    save_hf_model(model, out)  # over an existing export: the sharded files must go
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors"]
    assert [p.name for p in out.parent.iterdir()] == ["hf"]


def test_save_refuses_to_replace_a_directory_that_is_not_a_model(tmp_path):
    _, path = saved_hf_model(tmp_path)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    with pytest.raises(HFCheckpointError, match="notes"):
        save_hf_model(load_hf_model(path), tmp_path / "notes")
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"


# ------------------------------------------------------------------------------ errors

def test_missing_directory_is_named(tmp_path):
    with pytest.raises(HFCheckpointError, match="nowhere.*not found"):
        load_hf_model(tmp_path / "nowhere")


def test_missing_config_json_is_named(tmp_path):
    (tmp_path / "m").mkdir()
    with pytest.raises(HFCheckpointError, match=r"config\.json: not found"):
        load_hf_model(tmp_path / "m")


def test_malformed_config_json_is_named(tmp_path):
    _, path = saved_hf_model(tmp_path)
    (path / "config.json").write_text('{"hidden_size": 64,')
    with pytest.raises(HFCheckpointError, match=r"config\.json: not valid JSON") as info:
        load_hf_model(path)
    assert "\n" not in str(info.value)


def test_missing_weights_are_named(tmp_path):
    _, path = saved_hf_model(tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(HFCheckpointError, match=r"no model\.safetensors"):
        load_hf_model(path)


def test_missing_shard_named_by_index_is_named(tmp_path):
    _, path = saved_hf_model(tmp_path)
    out = save_hf_model(load_hf_model(path), tmp_path / "out", max_shard_bytes=40_000)
    shard = sorted(out.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(HFCheckpointError, match=shard.name):
        load_hf_model(out)


def test_untied_model_without_lm_head_fails_loudly(tmp_path):
    _, path = saved_hf_model(tmp_path, tie_word_embeddings=False)
    sd = load_file(path / "model.safetensors")
    del sd["lm_head.weight"]
    save_file(sd, path / "model.safetensors")
    with pytest.raises(HFCheckpointError, match="missing: lm_head.weight.*tie_word_embeddings"):
        load_hf_model(path)


def test_unexpected_key_is_named(tmp_path):
    _, path = saved_hf_model(tmp_path)
    sd = load_file(path / "model.safetensors")
    sd["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    save_file(sd, path / "model.safetensors")
    with pytest.raises(HFCheckpointError,
                       match=r"unexpected: model\.layers\.0\.self_attn\.q_proj\.bias"):
        load_hf_model(path)


def test_misshaped_tensor_is_named_with_both_shapes(tmp_path):
    _, path = saved_hf_model(tmp_path)
    sd = load_file(path / "model.safetensors")
    sd["model.layers.1.mlp.up_proj.weight"] = torch.zeros(100, 64)
    save_file(sd, path / "model.safetensors")
    with pytest.raises(HFCheckpointError,
                       match=r"misshaped: model\.layers\.1\.mlp\.up_proj\.weight \(100, 64\) "
                             r"\(expected \(192, 64\)\)"):
        load_hf_model(path)


def test_long_key_lists_are_truncated(tmp_path):
    args = args_from_hf_config(make_hf_model().config.to_dict())
    with pytest.raises(HFCheckpointError, match=r"\.\.\. \(\d+ more\)") as info:
        from_hf_state_dict({}, args)
    assert len(str(info.value)) < 600


def test_tied_checkpoint_with_a_different_lm_head_is_refused():
    model = make_hf_model(tie_word_embeddings=True)
    args = args_from_hf_config(model.config.to_dict())
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    sd["lm_head.weight"] = torch.zeros_like(sd["model.embed_tokens.weight"])
    with pytest.raises(HFCheckpointError, match="lm_head.weight differs"):
        from_hf_state_dict(sd, args)
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()  # a copy is fine
    assert "output.weight" in from_hf_state_dict(sd, args)


def test_pickle_only_checkpoint_is_refused_with_a_reason(tmp_path):
    _, path = saved_hf_model(tmp_path)
    (path / "model.safetensors").unlink()
    (path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(HFCheckpointError, match="safetensors only"):
        load_hf_model(path)
