"""Qwen3.5's language model (models/qwen3_5: Gated DeltaNet and gated full-attention
layers as layer_types says) against transformers' Qwen3_5ForCausalLM on tiny random
models: equal logits, equal greedy decodes alone and left-padded in a batch (the decoder
carries each linear layer's state beside the KV caches), an export that holds the same
tensors and that transformers loads with equal logits; layer_types read as given;
packed documents restart the linear layers' state; bad configs refused in one line; the
Hub's image-text directories (Qwen3_5ForConditionalGeneration): the language model
trained, the vision tower written back bit for bit on export."""
from __future__ import annotations

import json

import pytest
import torch

from helpers.hf_models import random_hf_causal_lm
from helpers.hf_parity import (assert_export_round_trip, assert_greedy_decode_equal,
                                assert_image_text_round_trip, tokens)
from lmforge.config import ConfigError
from lmforge.models.attention import DocumentMask
from lmforge.models.hf import HFCheckpointError, load_hf_model, read_model_args
from lmforge.models.presets import check_model_args
from lmforge.models.registry import PRESETS

LINEAR = dict(head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_conv_kernel_dim=4)
CASES = {  # id -> config fields
    # transformers' default pattern: three linear layers, then a full one
    "interval-4": dict(LINEAR, num_hidden_layers=4),
    # any pattern, read as given: full first, two linear in a row, tied embeddings
    "given-pattern-tied": dict(LINEAR, num_hidden_layers=4, tie_word_embeddings=True,
                               layer_types=["full_attention", "linear_attention",
                                            "linear_attention", "full_attention"]),
}


def _randomised(model):
    """transformers starts A_log, dt_bias and the norms at constants, which would hide a
    mapping mistake: perturb every parameter a little."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias", "norm.weight", "layernorm.weight")):
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(params=sorted(CASES), scope="module")
def hf_dir(request, tmp_path_factory):
    model = _randomised(random_hf_causal_lm("qwen3_5_text", seed=1, **CASES[request.param]))
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return model, path


@torch.no_grad()
def test_logits_equal_transformers(hf_dir):
    """To 1e-5 of the logits' scale (about 7 here: initializer_range 0.2): the chunked
    delta rule sums in another order than transformers' (measured 2.4e-5 absolute at
    seq 24 to 130, fp32; against transformers in float64 ours is the closer, 2.1e-5 to
    its 4.3e-5)."""
    hf_model, path = hf_dir
    x = tokens(hf_model.config.vocab_size, 70)  # (longer than a 64-token chunk)
    want, got = hf_model(x).logits, load_hf_model(path)(x)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_greedy_decode_equals_transformers_alone_and_in_a_batch(hf_dir):
    hf_model, path = hf_dir
    prompt = tokens(hf_model.config.vocab_size, 6)[0].tolist()
    assert_greedy_decode_equal(hf_model, path, prompt, 12)


def test_export_holds_the_same_tensors_and_loads_in_transformers(hf_dir, tmp_path):
    hf_model, path = hf_dir
    assert_export_round_trip(hf_model, path, tmp_path / "out",
                             tokens(hf_model.config.vocab_size, 24),
                             keys=("model_type", "layer_types", "head_dim",
                                   "linear_num_value_heads", "tie_word_embeddings"))
    assert read_model_args(tmp_path / "out") == read_model_args(path)


def test_layer_types_are_read_as_given(hf_dir):
    hf_model, path = hf_dir
    assert read_model_args(path).layer_types == tuple(hf_model.config.layer_types)


@torch.no_grad()
def test_a_packed_row_equals_its_documents_alone(hf_dir):
    """Two documents in one row: the linear layers' state and convolution window and the
    full layers' attention all restart at the second, whose logits are its own."""
    _, path = hf_dir
    model = load_hf_model(path).eval()
    x = tokens(model.args.vocab_size, 30, batch=1)
    segments = torch.tensor([[0] * 11 + [1] * 19])
    positions = torch.cat([torch.arange(11), torch.arange(19)])[None]
    packed = model(x, positions, DocumentMask(segments))
    for got, want in ((packed[:, :11], model(x[:, :11])), (packed[:, 11:], model(x[:, 11:]))):
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def _config(path, **fields):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(fields)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("fields, message", [
    (dict(layer_types=["linear_attention"] * 3), r"layer_types: 3 entries for "
     r"num_hidden_layers = 4"),
    (dict(layer_types=["linear_attention"] * 3 + ["sliding_attention"]),
     r"layer_types: 'sliding_attention' is not one of"),
    (dict(text_config={"hidden_size": 8}), r"text_config without vision_config"),
], ids=["layer-count", "layer-kind", "text-config-alone"])
def test_a_bad_config_is_refused_naming_the_field(hf_dir, tmp_path, fields, message):
    _, path = hf_dir
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((path / "config.json").read_text())
    _config(bad, **fields)
    with pytest.raises(HFCheckpointError, match=message) as refused:
        read_model_args(bad)
    assert "\n" not in str(refused.value)


def test_presets_check_their_pattern():
    args = PRESETS["qwen3.5-debug"]
    check_model_args(args)
    with pytest.raises(ConfigError, match=r"^model\.layer_types: 3 entries for 4 layers"):
        check_model_args(args.__class__(**{**args.__dict__,
                                           "layer_types": args.layer_types[:3]}))


def test_tp_must_split_the_linear_layers_into_whole_key_heads_and_pp_cp_are_refused():
    """Tensor parallelism splits a Gated DeltaNet by key heads (in_proj_qkv grouped per
    key head): tp=4 cannot split 2 of them, though the full-attention heads (4 kv) would
    allow it. pp and cp stay refused: the state runs through the whole sequence."""
    import dataclasses
    from lmforge.config import JobConfig
    from lmforge.models.presets import check_layout_fits

    args = dataclasses.replace(PRESETS["qwen3.5-debug"], n_heads=8, n_kv_heads=4)
    cfg = JobConfig()
    cfg.parallel.tp = 4
    with pytest.raises(ConfigError, match=r"^parallel\.tp: 4 must divide the 2 groups of the "
                                          r"fused in_proj_qkv \(q, k, v\)"):
        check_layout_fits(cfg, args)
    cfg.parallel.tp = 2
    check_layout_fits(cfg, args)
    for key in ("pp", "cp"):
        cfg = JobConfig()
        setattr(cfg.parallel, key, 2)
        with pytest.raises(ConfigError, match=rf"^parallel\.{key}: 2 is not supported for a "
                                              "model with linear-attention layers"):
            check_layout_fits(cfg, args)


# ------------------------------------------------------- the Hub's image-text layout

@pytest.fixture(scope="module")
def image_text_dir(tmp_path_factory):
    """A tiny Qwen3_5ForConditionalGeneration as the Hub's Qwen3.5 checkpoints are: the
    language model under model.language_model., a vision tower under model.visual."""
    import transformers

    torch.manual_seed(3)
    text = dict(LINEAR, vocab_size=97, hidden_size=64, intermediate_size=96,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=128)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                  out_hidden_size=64, patch_size=4, temporal_patch_size=2,
                  spatial_merge_size=2, num_position_embeddings=16)
    config = transformers.Qwen3_5Config(text_config=text, vision_config=vision)
    model = _randomised(transformers.Qwen3_5ForConditionalGeneration(config).eval())
    path = tmp_path_factory.mktemp("image-text")
    model.save_pretrained(path)
    return model, path


@torch.no_grad()
def test_an_image_text_directory_trains_its_language_model_and_exports_the_whole(
        image_text_dir, tmp_path):
    """Its language model loads (transformers' text-only logits), and the export holds
    every tensor of the original, the vision tower's bit for bit, with its config, so
    transformers loads the image-text model again with equal logits."""
    hf_model, path = image_text_dir
    assert_image_text_round_trip(hf_model, path, tmp_path / "out", tokens(97, 24))


def test_an_image_text_export_whose_source_moved_is_refused_in_one_line(image_text_dir,
                                                                        tmp_path):
    import shutil

    from lmforge.models.hf import save_hf_model

    _, path = image_text_dir
    moved = tmp_path / "copy"
    shutil.copytree(path, moved)
    model = load_hf_model(moved)
    shutil.rmtree(moved)
    with pytest.raises(HFCheckpointError, match=r"is not there to write its vision tower "
                       r"back from") as refused:
        save_hf_model(model, tmp_path / "out")
    assert "\n" not in str(refused.value) and not (tmp_path / "out").exists()
