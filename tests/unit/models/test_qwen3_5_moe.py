"""Qwen3.5-MoE's language model (models/qwen3_5_moe: Qwen3-Next's model with Qwen3.5's
separate linear-layer projections and its own config fields) against transformers'
Qwen3_5MoeForCausalLM on a tiny random model: equal logits, equal greedy decodes alone and
left-padded in a batch, an export whose files hold the original tensors and that
transformers loads with equal logits; layer_types read as given; a checkpoint missing a
linear layer's tensor refused in one line; the Hub's image-text directories
(Qwen3_5MoeForConditionalGeneration): the language model trained, the vision tower written
back bit for bit on export."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.hf_models import HYBRID_MOE_CONFIGS, randomise_linear_attention, saved_hybrid_moe
from helpers.hf_parity import (assert_export_round_trip, assert_greedy_decode_equal,
                                assert_image_text_round_trip, tokens)
from lmforge.models.common import count_parameters
from lmforge.models.hf import HFCheckpointError, load_hf_model, read_model_args
from lmforge.models.presets import check_model_args
from lmforge.models.registry import PRESETS, build_model

CONFIG = HYBRID_MOE_CONFIGS["qwen3_5_moe_text"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return saved_hybrid_moe(tmp_path_factory.mktemp("qwen3_5_moe"), "qwen3_5_moe_text")


@torch.no_grad()
def test_logits_equal_transformers(hf_dir):
    """To 1e-5 of the logits' scale (about 3), over more than one 64-token chunk."""
    hf_model, path = hf_dir
    x = tokens(hf_model.config.vocab_size, 70)
    want, got = hf_model(x).logits, load_hf_model(path)(x)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.long  # (5.7 s; the decoder runs test_qwen3_next's model, which make test decodes)
def test_greedy_decode_equals_transformers_alone_and_in_a_batch(hf_dir):
    hf_model, path = hf_dir
    prompt = tokens(hf_model.config.vocab_size, 6)[0].tolist()
    assert_greedy_decode_equal(hf_model, path, prompt, 12)


def test_export_holds_the_same_tensors_and_loads_in_transformers(hf_dir, tmp_path):
    hf_model, path = hf_dir
    after = assert_export_round_trip(
        hf_model, path, tmp_path / "out", tokens(hf_model.config.vocab_size, 24),
        keys=("model_type", "architectures", "layer_types", "num_experts",
              "moe_intermediate_size", "shared_expert_intermediate_size",
              "tie_word_embeddings", "head_dim"))
    assert not {"intermediate_size", "norm_topk_prob", "mlp_only_layers"} & after.keys()
    assert read_model_args(tmp_path / "out") == read_model_args(path)


def test_layer_types_are_read_as_given_and_every_layer_is_sparse(hf_dir):
    hf_model, path = hf_dir
    args = read_model_args(path)
    assert args.layer_types == tuple(hf_model.config.layer_types)
    assert args.sparse_layers == (0, 1, 2, 3) and args.norm_topk_prob


def test_a_checkpoint_missing_a_linear_layers_tensor_is_refused_naming_it(hf_dir, tmp_path):
    _, path = hf_dir
    sd = load_file(path / "model.safetensors")
    del sd["model.layers.1.linear_attn.in_proj_b.weight"]
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(HFCheckpointError, match=r"missing: model\.layers\.1\.linear_attn"
                                                r"\.in_proj_b\.weight") as refused:
        load_hf_model(tmp_path)
    assert "\n" not in str(refused.value)


@torch.no_grad()
def test_an_image_text_directory_trains_its_language_model_and_exports_the_whole(tmp_path):
    """The Hub's Qwen3.5-MoE checkpoints are Qwen3_5MoeForConditionalGeneration: the
    language model (experts under model.language_model.) loads with transformers' logits,
    the export holds every tensor of the original, the vision tower's bit for bit, with
    its config, and transformers loads the image-text model again with equal logits."""
    import transformers

    torch.manual_seed(3)
    text = {k: v for k, v in CONFIG.items() if k != "intermediate_size"} | dict(
        vocab_size=97, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                  out_hidden_size=64, patch_size=4, temporal_patch_size=2,
                  spatial_merge_size=2, num_position_embeddings=16)
    config = transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision)
    hf_model = transformers.Qwen3_5MoeForConditionalGeneration(config).eval()
    randomise_linear_attention(hf_model)
    path = tmp_path / "image-text"
    hf_model.save_pretrained(path)
    assert_image_text_round_trip(hf_model, path, tmp_path / "out", tokens(97, 24))


def test_presets_check_and_the_35b_has_35b_parameters():
    """34.7B: the released model's language model less its multi-token-prediction layer."""
    for name in ("qwen3.5-moe-debug", "qwen3.5-35b-a3b", "qwen3.5-397b-a17b"):
        check_model_args(PRESETS[name])
    assert count_parameters(build_model(PRESETS["qwen3.5-35b-a3b"])) == 34_660_610_688
