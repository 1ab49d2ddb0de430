"""gpt-oss (models/gpt_oss) against transformers' own on a tiny random model whose rows are
longer than its sliding window: equal logits, equal greedy decodes alone and in a batch,
a bit-identical export that transformers loads; MXFP4 expert weights (the released
checkpoints' form) loaded as the values they encode, and refused in one line naming the
tensor when their shape is not the config's; the attention sinks under a packed batch's
mask and refused under flex; the presets' parameter counts."""
from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.hf_models import random_hf_causal_lm
from helpers.hf_parity import (assert_export_round_trip, assert_greedy_decode_equal,
                               assert_lora_round_trip,
                               assert_logits_equal, tokens)
from lmforge.models.attention import DocumentMask, attend
from lmforge.models.common import count_parameters
from lmforge.models.hf import HFCheckpointError, load_hf_model, read_model_args, save_hf_model
from lmforge.models.mxfp4 import FP4_VALUES, SCALE_BIAS
from lmforge.models.registry import PRESETS, args_from_dict, build_model

CONFIG = dict(num_local_experts=8, num_experts_per_tok=2, head_dim=16, intermediate_size=32,
              sliding_window=6, num_hidden_layers=3)  # sliding, global, sliding
SEQ = 24


def _random_gpt_oss(seed: int = 1):
    """The tiny model with its sinks, router and expert biases randomised too
    (transformers starts some at zero, which would hide a mapping mistake)."""
    model = random_hf_causal_lm("gpt_oss", seed=seed, **CONFIG)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("_bias", "sinks", "router.bias")):
                p.add_(torch.randn(p.shape, generator=g))
    return model


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    model = _random_gpt_oss()
    path = tmp_path_factory.mktemp("gpt_oss")
    model.save_pretrained(path)
    return model, path


def test_logits_equal_transformers(hf_dir):
    hf_model, path = hf_dir
    assert_logits_equal(hf_model, path, tokens(hf_model.config.vocab_size, SEQ))


def test_greedy_decode_equals_transformers_alone_and_in_a_batch(hf_dir):
    hf_model, path = hf_dir
    prompt = tokens(hf_model.config.vocab_size, 6)[0].tolist()
    assert_greedy_decode_equal(hf_model, path, prompt, 12)  # 18 positions > window 6


def test_export_is_bit_identical_and_loads_in_transformers(hf_dir, tmp_path):
    hf_model, path = hf_dir
    assert_export_round_trip(
        hf_model, path, tmp_path / "out", tokens(hf_model.config.vocab_size, SEQ),
        keys=("model_type", "architectures", "tie_word_embeddings", "head_dim",
              "intermediate_size", "num_local_experts", "num_experts_per_tok",
              "sliding_window", "layer_types", "rope_parameters", "swiglu_alpha",
              "swiglu_limit", "attention_bias"))
    assert read_model_args(tmp_path / "out") == read_model_args(path)


@torch.no_grad()
def test_a_packed_batch_attends_within_each_document_sinks_included(hf_dir):
    """Two documents packed in one row give each document's logits alone: the sinks
    join every softmax under the dense document mask as under the causal one."""
    model = load_hf_model(hf_dir[1])
    x = tokens(model.args.vocab_size, SEQ, batch=1)
    segments = torch.tensor([[0] * 10 + [1] * (SEQ - 10)])
    positions = torch.cat((torch.arange(10), torch.arange(SEQ - 10)))[None]
    packed = model(x, positions, DocumentMask(segments))
    torch.testing.assert_close(packed[:, :10], model(x[:, :10]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed[:, 10:], model(x[:, 10:]), rtol=1e-5, atol=1e-5)


def test_sinks_take_their_share_of_the_softmax_and_get_gradients():
    """attend with sinks equals the explicit softmax over the scores and the sink (as
    transformers' eager attention), over a cache and a window; the sinks get gradients."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, s, 8, generator=g) for h, s in ((4, 3), (2, 7), (2, 7)))
    sinks = torch.randn(4, generator=g, requires_grad=True)
    out = attend(q, k, v, past=4, window=5, sinks=sinks)
    scores = q @ k.repeat_interleave(2, 1).transpose(2, 3) / 8 ** 0.5  # (2, 4, 3, 7)
    query, key = torch.arange(4, 7)[:, None], torch.arange(7)[None]
    scores = scores.masked_fill((key > query) | (key <= query - 5), float("-inf"))
    probs = torch.cat((scores, sinks.view(1, 4, 1, 1).expand(2, 4, 3, 1)), -1).softmax(-1)
    expected = probs[..., :-1] @ v.repeat_interleave(2, 1)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    grad, = torch.autograd.grad(out.square().sum(), sinks)
    expected_grad, = torch.autograd.grad(expected.square().sum(), sinks)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-5)


def test_args_survive_their_record():
    for args in (PRESETS["gpt-oss-20b"], dataclasses.replace(
            PRESETS["gpt-oss-debug"], layer_types=("global", "global"))):
        assert args_from_dict(json.loads(json.dumps(dataclasses.asdict(args)))) == args


def test_sinks_are_refused_under_flex():
    q = k = v = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="flex.*sinks"):
        attend(q, k, v, DocumentMask(torch.zeros(1, 4, dtype=torch.long), "flex"),
               sinks=torch.zeros(2))


# ------------------------------------------------------------------------------ MXFP4

def _mxfp4(shape: tuple[int, int, int], g: torch.Generator):
    """Random MXFP4 blocks and scales for an (experts, in, out) weight, and the weight
    they encode: FP4 values times powers of two, exact in any float dtype."""
    experts, inner, rows = shape
    codes = torch.randint(0, 16, (experts, rows, inner // 32, 32), generator=g)
    scales = torch.randint(SCALE_BIAS - 4, SCALE_BIAS + 4, codes.shape[:3], generator=g)
    blocks = (codes[..., 0::2] | codes[..., 1::2] << 4).to(torch.uint8)  # low nibble first
    values = torch.tensor(FP4_VALUES)[codes] * 2.0 ** (scales - SCALE_BIAS)[..., None]
    weight = values.flatten(2).transpose(1, 2)  # (experts, in, out)
    return blocks, scales.to(torch.uint8), weight.contiguous()


def _quantized_dir(path, out):
    """``path``'s checkpoint with every expert weight in MXFP4, as the released files
    hold them; returns the weights they encode, by name."""
    shutil.copytree(path, out)
    sd, g, encoded = load_file(out / "model.safetensors"), torch.Generator().manual_seed(3), {}
    for name in [k for k in sd if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales, encoded[name] = _mxfp4(tuple(sd.pop(name).shape), g)
        sd[f"{name}_blocks"], sd[f"{name}_scales"] = blocks, scales
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (out / "config.json").write_text(json.dumps(config))
    return encoded


def test_mxfp4_experts_load_as_the_values_they_encode_and_export_plain(hf_dir, tmp_path):
    encoded = _quantized_dir(hf_dir[1], tmp_path / "mxfp4")
    save_hf_model(load_hf_model(tmp_path / "mxfp4"), tmp_path / "out")
    exported = load_file(tmp_path / "out" / "model.safetensors")
    assert len(encoded) == 2 * CONFIG["num_hidden_layers"]
    assert all(torch.equal(exported[name], weight) for name, weight in encoded.items())
    assert not any(k.endswith(("_blocks", "_scales")) for k in exported)
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())


def test_mxfp4_blocks_of_another_shape_than_the_config_are_refused(hf_dir, tmp_path):
    _quantized_dir(hf_dir[1], tmp_path / "mxfp4")
    config = json.loads((tmp_path / "mxfp4" / "config.json").read_text())
    (tmp_path / "mxfp4" / "config.json").write_text(json.dumps(config | {
        "intermediate_size": 16}))
    with pytest.raises(HFCheckpointError,
                       match=r"model\.layers\.0\.mlp\.experts\.\w+_proj: blocks .* "
                             r"dequantize to .* but the config expects"):
        load_hf_model(tmp_path / "mxfp4")


def test_other_quantizations_are_refused_naming_the_field(hf_dir, tmp_path):
    shutil.copytree(hf_dir[1], tmp_path / "gptq")
    config = json.loads((tmp_path / "gptq" / "config.json").read_text())
    (tmp_path / "gptq" / "config.json").write_text(json.dumps(config | {
        "quantization_config": {"quant_method": "gptq"}}))
    with pytest.raises(HFCheckpointError, match="quantization_config.quant_method = 'gptq'"):
        read_model_args(tmp_path / "gptq")


def test_presets_have_the_released_parameter_counts():
    """transformers' GptOssForCausalLM holds 20,914,757,184 and 116,829,156,672 (built on
    the meta device from the released config.json's shapes)."""
    assert count_parameters(build_model(PRESETS["gpt-oss-20b"])) == 20_914_757_184
    assert count_parameters(build_model(PRESETS["gpt-oss-120b"])) == 116_829_156_672
    model = build_model(PRESETS["gpt-oss-debug"], "cpu")  # the test size builds and runs
    model.init_weights()
    assert model(torch.zeros(1, 12, dtype=torch.long)).shape == (1, 12, 259)


def test_lora_on_attention_and_experts_loads_in_peft_and_the_merged_export_agrees(
        hf_dir, tmp_path):
    """all-linear: the attention's linears and the experts' stacked weights (peft's
    target_parameters); peft loads the adapter on transformers' model with our logits."""
    hf_model, path = hf_dir
    # (5e-5: peft adds B A to the transposed, interleaved stack in another order; a
    # wrong layout is off by ~1)
    assert_lora_round_trip(hf_model, path, tmp_path, tokens(hf_model.config.vocab_size, 24),
                           tolerance=5e-5)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
