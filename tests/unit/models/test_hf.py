"""Hugging Face / Meta checkpoint import and export against transformers' own Llama."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402

from helpers.hf_models import random_hf_llama  # noqa: E402
from lmforge.data.tokenizer import train_bpe  # noqa: E402
from lmforge.models.llama import apply_rope, rope_cos_sin  # noqa: E402
from lmforge.models.hf import (  # noqa: E402
    HFCheckpointError, args_from_hf_config, args_from_meta_params, from_hf_state_dict,
    hf_config_from_args, load_hf_model, load_meta_checkpoint, meta_ffn_dim,
    read_hf_state_dict, save_hf_model, to_hf_state_dict, to_meta_state_dict)

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
# head_dim 16: with original_max_position_embeddings 32 the Llama-3 scaling leaves some
# frequencies alone, interpolates some and divides the rest, so all three branches run.
VARIANTS = {
    "gqa_untied": dict(num_key_value_heads=2, tie_word_embeddings=False),
    "mha_tied": dict(num_key_value_heads=4, tie_word_embeddings=True),
    "gqa_tied_llama3_scaling": dict(num_key_value_heads=1, tie_word_embeddings=True,
                                    rope_theta=500000.0, rope_scaling=LLAMA3_SCALING),
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
    caches = model.new_caches(tokens.shape[0], tokens.shape[1] + new_tokens) if use_cache else None
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


@pytest.mark.parametrize("field,value", [("model_type", "mistral"), ("hidden_act", "gelu"),
                                         ("attention_bias", True), ("head_dim", 32)])
def test_config_refuses_unsupported_fields_naming_them(field, value):
    config = hf_config_from_args(args_from_hf_config(make_hf_model().config.to_dict()))
    config[field] = value
    with pytest.raises(ValueError, match=field):
        args_from_hf_config(config)


def test_config_refuses_non_llama3_rope_scaling():
    config = make_hf_model().config.to_dict()
    config["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}
    with pytest.raises(ValueError, match="rope_parameters.rope_type"):
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
    reloaded = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
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


# ------------------------------------------------------------------------- Meta layout

def meta_params(config: LlamaConfig, vocab_size: int) -> dict:
    return {"dim": config.hidden_size, "n_layers": config.num_hidden_layers,
            "n_heads": config.num_attention_heads, "n_kv_heads": config.num_key_value_heads,
            "vocab_size": vocab_size, "multiple_of": 32, "ffn_dim_multiplier": None,
            "norm_eps": config.rms_norm_eps, "rope_theta": 10000.0, "use_scaled_rope": False}


def split_meta_shards(sd: dict, n: int, embedding_dim: int) -> list[dict]:
    """Model-parallel split as Meta's code does it: column-parallel weights by rows,
    row-parallel ones by columns, norms replicated."""
    def split_dim(key):
        if key == "tok_embeddings.weight":
            return embedding_dim
        if key.endswith(("wo.weight", "w2.weight")):
            return 1
        if key.endswith(("wq.weight", "wk.weight", "wv.weight", "w1.weight", "w3.weight",
                         "output.weight")):
            return 0
        return None
    shards = [{} for _ in range(n)]
    for key, tensor in sd.items():
        dim = split_dim(key)
        parts = [tensor] * n if dim is None else tensor.chunk(n, dim=dim)
        for shard, part in zip(shards, parts):
            shard[key] = part.clone()
    return shards


def test_meta_ffn_dim_matches_released_models():
    assert meta_ffn_dim(4096, 256, None) == 11008  # llama2-7b
    assert meta_ffn_dim(5120, 256, None) == 13824  # llama2-13b
    assert meta_ffn_dim(8192, 4096, 1.3) == 28672  # llama2-70b, llama3-70b
    assert meta_ffn_dim(4096, 1024, 1.3) == 14336  # llama3-8b
    assert meta_ffn_dim(2048, 256, 1.5) == 8192  # llama3.2-1b


def test_meta_params_with_scaled_rope_give_llama31_scaling():
    args = args_from_meta_params({"dim": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8,
                                  "vocab_size": 128256, "multiple_of": 1024,
                                  "ffn_dim_multiplier": 1.3, "norm_eps": 1e-5,
                                  "rope_theta": 500000.0, "use_scaled_rope": True})
    assert args.ffn_dim == 14336 and args.rope_scaling.factor == 8.0
    assert args.rope_scaling.original_max_position_embeddings == 8192


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_meta_single_shard_import_equals_hf_import(tmp_path, tied):
    reference, path = saved_hf_model(tmp_path, tie_word_embeddings=tied)
    from_hf = load_hf_model(path)
    meta_dir = tmp_path / "meta"
    meta_dir.mkdir()
    torch.save(to_meta_state_dict(from_hf.state_dict(), from_hf.args),
               meta_dir / "consolidated.00.pth")
    (meta_dir / "params.json").write_text(json.dumps(meta_params(reference.config, VOCAB)))
    from_meta = load_meta_checkpoint(meta_dir)
    # params.json has no context length or init std; everything else must agree.
    assert from_meta.args == dataclasses.replace(
        from_hf.args, max_seq_len=from_meta.args.max_seq_len, init_std=from_meta.args.init_std)
    hf_sd, meta_sd = from_hf.state_dict(), from_meta.state_dict()
    assert hf_sd.keys() == meta_sd.keys()
    assert all(torch.equal(hf_sd[k], meta_sd[k]) for k in hf_sd)
    assert (from_meta.output.weight is from_meta.tok_embeddings.weight) == tied


def test_meta_layout_differs_from_hf_layout_in_q_and_k_only(tmp_path):
    _, path = saved_hf_model(tmp_path)
    model = load_hf_model(path)
    meta = to_meta_state_dict(model.state_dict(), model.args)
    assert not torch.equal(meta["layers.0.attention.wq.weight"],
                           model.layers["0"].attention.q_proj.weight)
    assert torch.equal(meta["layers.0.attention.wv.weight"],
                       model.layers["0"].attention.v_proj.weight)


def meta_interleaved_rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Meta's reference RoPE: (seq, heads, head_dim) rotated as complex pairs (2i, 2i+1)."""
    seq, head_dim = x.shape[0], x.shape[-1]
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(seq).float(), freqs)  # (seq, head_dim/2)
    rotation = torch.polar(torch.ones_like(angles), angles)
    pairs = torch.view_as_complex(x.reshape(seq, x.shape[1], -1, 2).contiguous())
    return torch.view_as_real(pairs * rotation[:, None]).flatten(-2)


@torch.no_grad()
def test_meta_permutation_turns_interleaved_rope_into_rotate_half(tmp_path):
    """Attention scores from Meta's weights under Meta's RoPE equal ours under ours: checks
    the direction of the q/k permutation independently of our own inverse."""
    _, path = saved_hf_model(tmp_path, num_key_value_heads=2)
    model = load_hf_model(path)
    args, attention = model.args, model.layers["0"].attention
    meta = to_meta_state_dict(model.state_dict(), args)
    x = torch.randn(10, args.dim, generator=torch.Generator().manual_seed(3))
    wq, wk = meta["layers.0.attention.wq.weight"], meta["layers.0.attention.wk.weight"]
    q_meta = meta_interleaved_rope((x @ wq.T).view(10, 4, 16), 1e4)  # (seq, heads, hd)
    k_meta = meta_interleaved_rope((x @ wk.T).view(10, 2, 16), 1e4)  # (seq, kv_heads, hd)
    scores_meta = torch.einsum("qhd,khd->hqk", q_meta, k_meta.repeat_interleave(2, dim=1))

    cos, sin = rope_cos_sin(args, torch.arange(10)[None])
    q = apply_rope(attention.q_proj(x).view(1, 10, 4, 16).transpose(1, 2), cos, sin)[0]
    k = apply_rope(attention.k_proj(x).view(1, 10, 2, 16).transpose(1, 2), cos, sin)[0]
    scores = torch.einsum("hqd,hkd->hqk", q, k.repeat_interleave(2, dim=0))
    torch.testing.assert_close(scores, scores_meta, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("embedding_dim", [1, 0], ids=["llama2_embedding_by_columns",
                                                        "llama3_embedding_by_rows"])
def test_meta_two_shard_import_equals_hf_import(tmp_path, embedding_dim):
    reference, path = saved_hf_model(tmp_path, num_key_value_heads=2)
    from_hf = load_hf_model(path)
    meta_dir = tmp_path / "meta"
    meta_dir.mkdir()
    meta_sd = to_meta_state_dict(from_hf.state_dict(), from_hf.args)
    for i, shard in enumerate(split_meta_shards(meta_sd, 2, embedding_dim)):
        torch.save(shard, meta_dir / f"consolidated.{i:02d}.pth")
    # Llama 2's params.json says vocab_size -1: the loader reads it off the weights.
    (meta_dir / "params.json").write_text(json.dumps(meta_params(reference.config, -1)))
    from_meta = load_meta_checkpoint(meta_dir)
    assert from_meta.args.vocab_size == VOCAB
    hf_sd, meta_loaded = from_hf.state_dict(), from_meta.state_dict()
    assert all(torch.equal(hf_sd[k], meta_loaded[k]) for k in hf_sd)


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


def test_meta_checkpoint_without_params_json_is_named(tmp_path):
    (tmp_path / "meta").mkdir()
    with pytest.raises(HFCheckpointError, match=r"params\.json: not found"):
        load_meta_checkpoint(tmp_path / "meta")
