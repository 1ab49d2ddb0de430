"""Qwen3.5-MoE exported to GGUF (models/qwen3_5_moe/gguf.py, llama.cpp's qwen35moe) and
run in llama.cpp itself, on tiny transformers-made Qwen3_5MoeForCausalLM directories
(Qwen3.5's Gated DeltaNet and gated full-attention layers, experts and a gated shared
expert on every layer; A_log, dt_bias and the norms perturbed): llama.cpp's greedy tokens
after prompts of 1, 6 and 70 tokens equal lmforge's and transformers' from the f32 export
made by `lmforge export`, and lmforge's from the f16 one (up to a near tie, of the logits
or of a router's choice, that llama.cpp's f16 rounding of activations flips); the f32
file's tensors are the converter's, byte for byte, and its keys too but EOS and, under a
32-feature head, the rope sections; a Hub-shaped image-text directory's language model
runs alone, its multi-token-prediction layers left out; a LoRA GGUF on its base's gives
the adapted model's tokens; what llama.cpp's qwen35moe cannot compute (or the export
cannot place: an out_proj adapter) is refused in one line naming the architecture and
llama.cpp's version."""
from __future__ import annotations

import json

import pytest
import torch

from helpers.llama_cpp_runs import (assert_as_converted, assert_greedy_as_lmforge,
                                    greedy_tokens, hybrid_dir, lmforge_export, prompts)
from lmforge.export.gguf import GGUFError, export_gguf, export_gguf_lora
from lmforge.models.generate import generate
from lmforge.models.hf import load_hf_model
from lmforge.models.qwen3_5.gguf import LLAMA_CPP_PYTHON

pytestmark = pytest.mark.deploy
NEW_TOKENS = 24
L, F = "linear_attention", "full_attention"
SPARSE = dict(head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_conv_kernel_dim=4,
              num_hidden_layers=4, num_experts=8, num_experts_per_tok=2,
              moe_intermediate_size=24, shared_expert_intermediate_size=40)
CASES = {
    # transformers' pattern (three linear layers, then a full one); two value heads per
    # key head (llama.cpp tiles them); a head too small for Qwen3.5's rope sections
    "interval-4": SPARSE,
    # a pattern read as given, full first, tied embeddings; the released heads' shape
    # (head_dim 256 there): Qwen3.5's rope sections as the converter writes them
    "given-pattern-tied-head_dim128": SPARSE | dict(
        layer_types=[F, L, L, F], tie_word_embeddings=True, head_dim=128,
        linear_num_value_heads=2),
}


def moe_dir(root, **config):
    """A Hub-shaped Qwen3_5MoeForCausalLM directory: its config.json without the
    intermediate_size the test helper's shape gives (Qwen3.5-MoE's config has none, and
    the converter writes it as feed_forward_length where it is)."""
    hybrid_dir(root, "qwen3_5_moe_text", **config)
    path = root / "config.json"
    config = json.loads(path.read_text())
    del config["intermediate_size"]
    path.write_text(json.dumps(config, indent=2))
    return root


@pytest.fixture(params=sorted(CASES), scope="module")
def model_dir(request, tmp_path_factory):
    # (a neutral directory name: llama.cpp keys special-token rules on general.name)
    return moe_dir(tmp_path_factory.mktemp(request.param) / "model", **CASES[request.param])


# As for Qwen3-Next (tests/deploy/test_qwen3_next_gguf.py, where a router's near tie
# flipped one run): of the six f16 runs here, two left lmforge's tokens, where lmforge's
# top two logits were 0.004 and 0.013 apart
NEAR_TIE = 0.05
ROUTER_TIE = 1e-3


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_llama_cpp_greedy_tokens_equal_lmforges_and_transformers(model_dir, tmp_path, dtype):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed "
                        "(make test-deploy installs it)")
    out = lmforge_export(model_dir, tmp_path / "model.gguf", dtype)
    assert_greedy_as_lmforge(model_dir, out, dtype, NEW_TOKENS, NEAR_TIE, ROUTER_TIE)


def test_every_key_and_tensor_of_llama_cpps_converter_is_in_our_export(model_dir, tmp_path):
    """The converter's keys with their values in ours (but EOS, and a head under 32
    features gets rope sections that fit it: the converter's [11, 11, 10, 0] make ggml
    abort there), and the same tensors (value heads tiled, experts stacked), byte for
    byte."""
    small_head = json.loads((model_dir / "config.json").read_text())["head_dim"] < 32
    assert_as_converted(model_dir, tmp_path, "qwen35moe",
                        {"qwen35moe.rope.dimension_sections"} if small_head else ())


@pytest.mark.parametrize("fields, message", [
    (dict(linear_value_head_dim=16), r"linear_value_head_dim \(16\) differs from "
     r"linear_key_head_dim \(8\), and llama\.cpp's qwen35moe"),
    (dict(layer_types=[L] * 4), r"layer_types: every layer is linear_attention, and "
     r"llama\.cpp's qwen35moe"),
    (dict(layer_types=[F] * 4), r"layer_types: every layer is full_attention"),
], ids=["value-head-dim", "all-linear", "all-full"])
def test_what_llama_cpp_cannot_compute_is_refused_in_one_line(tmp_path, fields, message):
    """(Measured: llama.cpp 0.3.36 aborts on a model of one kind of layer.)"""
    src = moe_dir(tmp_path / "model", **(SPARSE | fields))
    with pytest.raises(GGUFError, match=message) as refused:
        export_gguf(src, tmp_path / "model.gguf")
    text = str(refused.value)
    assert f"llama-cpp-python {LLAMA_CPP_PYTHON}" in text and "\n" not in text
    assert not (tmp_path / "model.gguf").exists()


def test_a_hub_shaped_image_text_directorys_language_model_runs_in_llama_cpp(tmp_path):
    """A Hub-shaped Qwen3_5MoeForConditionalGeneration directory (the language model
    under model.language_model., a vision tower under model.visual., and the
    multi-token-prediction layers the released checkpoints hold, mtp.*, which lmforge does
    not build): its language model alone in the file, as the converter writes it with
    --no-mtp, with lmforge's greedy tokens."""
    import gguf
    import transformers
    from safetensors.torch import load_file, save_file

    from helpers.hf_models import randomise_linear_attention
    from helpers.real_tokenizers import save_tokenizer
    from lmforge.data.tokenizer import load_tokenizer

    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    src = tmp_path / "model"
    save_tokenizer("chatml", src)
    text = SPARSE | dict(vocab_size=load_tokenizer(src).vocab_size, hidden_size=64,
                         num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, initializer_range=0.2)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                  out_hidden_size=64, patch_size=4, temporal_patch_size=2,
                  spatial_merge_size=2, num_position_embeddings=16)
    torch.manual_seed(3)
    model = transformers.Qwen3_5MoeForConditionalGeneration(
        transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision)).eval()
    randomise_linear_attention(model).save_pretrained(src)
    weights = load_file(src / "model.safetensors")
    mtp = {"mtp.fc.weight": torch.randn(64, 128), "mtp.norm.weight": torch.randn(64),
           "mtp.layers.0.input_layernorm.weight": torch.randn(64)}
    save_file(weights | mtp, src / "model.safetensors", metadata={"format": "pt"})
    out = export_gguf(src, tmp_path / "model.gguf", "f32")
    names = {t.name for t in gguf.GGUFReader(out).tensors}
    assert {n.split(".")[0] for n in names} == {"token_embd", "blk", "output_norm", "output"}
    assert {n.split(".")[1] for n in names if n.startswith("blk.")} == {"0", "1", "2", "3"}
    ours = load_hf_model(src)
    asked = prompts(ours.args.vocab_size)[:2]
    expected = [generate(ours, [p], NEW_TOKENS)[0].ids for p in asked]
    assert greedy_tokens(out, asked, NEW_TOKENS) == expected


@pytest.fixture
def lora_model(tmp_path):
    """interval-4's model with random LoRA adapters on ``targets``: (model, base
    directory)."""
    from lmforge.config import LoraConfig
    from lmforge.peft import apply_lora, lora_layers

    def adapted(targets: list[str]):
        base = moe_dir(tmp_path / "base", **CASES["interval-4"])
        model = load_hf_model(base)
        apply_lora(model, LoraConfig(enabled=True, rank=4, alpha=8.0, targets=targets))
        g = torch.Generator().manual_seed(0)
        for layer in lora_layers(model).values():  # adapters that change the tokens
            layer.lora_b.data = torch.randn(layer.lora_b.shape, generator=g) * 0.3
        return model, base

    return adapted


def test_a_lora_gguf_on_its_base_gives_the_adapted_models_tokens(lora_model, tmp_path):
    """Adapters on the linear layers' input projections (B's value-head rows tiled as
    the weights') and on the full layers' q and v."""
    from lmforge.peft import save_adapter

    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    model, base = lora_model(["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
                              "q_proj", "v_proj"])
    adapter = save_adapter(model, tmp_path / "adapter", base_model_path=str(base))
    base_gguf = export_gguf(base, tmp_path / "base.gguf", "f32")
    lora_gguf = export_gguf_lora(adapter, base, tmp_path / "lora.gguf")
    asked = prompts(model.args.vocab_size)[:2]
    expected = [generate(model, [p], NEW_TOKENS)[0].ids for p in asked]
    unadapted = load_hf_model(base)
    assert expected != [generate(unadapted, [p], NEW_TOKENS)[0].ids for p in asked]
    assert greedy_tokens(base_gguf, asked, NEW_TOKENS, lora_path=str(lora_gguf)) == expected


def test_a_lora_gguf_with_an_out_proj_adapter_is_refused_in_one_line(lora_model, tmp_path):
    """out_proj's value heads are its A's columns, which llama.cpp reads tiled and the
    export's hook (B's rows) cannot reorder: refused, nothing written."""
    from lmforge.peft import save_adapter

    model, base = lora_model(["in_proj_z", "out_proj"])
    adapter = save_adapter(model, tmp_path / "adapter", base_model_path=str(base))
    with pytest.raises(ValueError, match=r"out_proj\.weight: no GGUF form of a LoRA "
                                         r"adapter on out_proj: llama\.cpp's qwen35moe "
                                         r"\(llama-cpp-python 0\.3\.36\)"):
        export_gguf_lora(adapter, base, tmp_path / "lora.gguf")
    assert not (tmp_path / "lora.gguf").exists()
