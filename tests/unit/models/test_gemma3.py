"""Gemma 3 (text) loads from a transformers directory with equal logits and greedy
decodes past its sliding window, with sliding and global layers interleaved by the
pattern or by an explicit layer_types list; exports back bit-identical; takes LoRA
adapters that peft loads; refuses what it does not compute, naming the field."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from lmforge.config import ConfigError, LoraConfig
from lmforge.models.common import count_parameters
from lmforge.models.generate import generate
from lmforge.models.hf import HFCheckpointError, load_hf_model, save_hf_model
from lmforge.models.presets import PRESETS, check_model_args
from lmforge.models.registry import build_model
from lmforge.peft import apply_lora, export_merged, lora_layers, save_adapter
from helpers.hf_models import load_reference, random_hf_causal_lm

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
    return torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(0))


def test_layer_kinds_follow_the_config(hf_dir):
    hf_model, path = hf_dir
    kinds = load_hf_model(path).args.attention_kinds
    expected = tuple("sliding" if t == "sliding_attention" else "global"
                     for t in hf_model.config.layer_types)
    assert kinds == expected and {"sliding", "global"} <= set(kinds)


def test_logits_equal_transformers_past_the_window(hf_dir):
    hf_model, path = hf_dir
    ours = load_hf_model(path)
    tokens = _tokens(ours.args.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf_model(tokens).logits, rtol=1e-5, atol=1e-5)


def test_greedy_decode_equals_transformers(hf_dir):
    hf_model, path = hf_dir
    prompt = _tokens(hf_model.config.vocab_size, 5)[0].tolist()
    ours = generate(load_hf_model(path), prompt, 12, greedy=True)  # 17 tokens > window 6
    theirs = hf_model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                               min_new_tokens=12, pad_token_id=0)
    assert ours == theirs[0, len(prompt):].tolist()


def test_export_is_bit_identical_and_loads_in_transformers(hf_dir, tmp_path):
    hf_model, path = hf_dir
    save_hf_model(load_hf_model(path), tmp_path / "out")
    original, exported = load_file(path / "model.safetensors"), load_file(
        tmp_path / "out" / "model.safetensors")
    assert original.keys() == exported.keys()
    assert all(torch.equal(original[k], exported[k]) for k in original)
    after = json.loads((tmp_path / "out" / "config.json").read_text())
    assert after["layer_types"] == hf_model.config.layer_types
    reloaded = load_reference(tmp_path / "out")
    tokens = _tokens(hf_model.config.vocab_size)
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, hf_model(tokens).logits)


@torch.no_grad()
def test_lora_adapter_loads_in_peft_and_the_merged_export_agrees(hf_dir, tmp_path):
    peft = pytest.importorskip("peft")
    hf_model, path = hf_dir
    ours = load_hf_model(path).eval()
    apply_lora(ours, LoraConfig(enabled=True, rank=4, alpha=8.0, targets="all-linear"))
    g = torch.Generator().manual_seed(2)
    for layer in lora_layers(ours).values():
        layer.lora_a.copy_(torch.randn(layer.lora_a.shape, generator=g) * 0.2)
        layer.lora_b.copy_(torch.randn(layer.lora_b.shape, generator=g) * 0.2)
    adapter = save_adapter(ours, tmp_path / "adapter", base_model_path=str(path))
    merged = export_merged(ours, tmp_path / "merged", dtype=torch.float32)
    x = _tokens(hf_model.config.vocab_size)
    base = hf_model(x).logits
    with_adapter = peft.PeftModel.from_pretrained(hf_model, adapter).eval()
    reference = with_adapter(x).logits
    with_adapter.unload()
    assert (reference - base).abs().max() > 1e-3
    torch.testing.assert_close(ours(x), reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(load_reference(merged)(x).logits, reference,
                               rtol=1e-4, atol=1e-4)


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
