"""Qwen3.5's language model exported to GGUF (models/qwen3_5/gguf.py, llama.cpp's qwen35)
and run in llama.cpp itself, on tiny transformers-made Qwen3_5ForCausalLM directories
(Gated DeltaNet and gated full-attention layers; A_log, dt_bias and the norms
perturbed, as transformers starts them at constants): llama.cpp's greedy tokens after
prompts of 1, 6 and 70 tokens (the last past a 64-token chunk, fed in ubatches of 32)
equal lmforge's and transformers' from the f32 export, and lmforge's from the f16 one
(up to a near tie that llama.cpp's f16 rounding of activations flips); the f32 file's
tensors are the converter's, byte for byte, and its keys too but where ours differ on
purpose; a Hub-shaped image-text directory's language model runs alone; a LoRA GGUF
on its base's gives the adapted model's tokens; what llama.cpp's qwen35 cannot compute
(or the export cannot place: an out_proj adapter) is refused in one line naming the
field and llama.cpp's version."""
from __future__ import annotations

import pytest
import torch

from helpers.hf_models import hf_model_dir
from helpers.llama_cpp_runs import (assert_as_converted, assert_greedy_as_lmforge,
                                    greedy_tokens)
from helpers.llama_cpp_runs import prompts as seeded_prompts
from lmforge.export.gguf import GGUFError, export_gguf
from lmforge.models.generate import generate
from lmforge.models.hf import load_hf_model
from lmforge.models.qwen3_5.gguf import LLAMA_CPP_PYTHON

pytestmark = pytest.mark.deploy
NEW_TOKENS = 24
LINEAR = dict(head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_conv_kernel_dim=4,
              num_hidden_layers=4)
L, F = "linear_attention", "full_attention"
CASES = {
    # transformers' pattern (three linear layers, then a full one); two value heads per
    # key head (llama.cpp tiles them); a head too small for Qwen3.5's rope sections
    "interval-4": LINEAR,
    # a pattern read as given, full first, tied embeddings
    "given-pattern-tied": LINEAR | dict(layer_types=[F, L, L, F], tie_word_embeddings=True),
    # the released heads' shape (head_dim 256 there): Qwen3.5's rope sections as the
    # converter writes them; one value head per key head
    "head_dim128": LINEAR | dict(head_dim=128, linear_num_value_heads=2,
                                 layer_types=[L, F, L, F]),
}
PERTURBED = ("A_log", "dt_bias", "norm.weight", "layernorm.weight")


def _perturbed(model_dir):
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    g = torch.Generator().manual_seed(3)
    for name, t in tensors.items():
        if name.endswith(PERTURBED):
            tensors[name] = t + 0.3 * torch.randn(t.shape, generator=g)
    save_file(tensors, path, metadata={"format": "pt"})
    return model_dir


@pytest.fixture(params=sorted(CASES), scope="module")
def model_dir(request, tmp_path_factory):
    # (a neutral directory name: llama.cpp keys special-token rules on general.name)
    root = tmp_path_factory.mktemp(request.param) / "model"
    return _perturbed(hf_model_dir(root, "qwen3_5_text", seed=3, **CASES[request.param]))


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_llama_cpp_greedy_tokens_equal_lmforges_and_transformers(model_dir, tmp_path, dtype):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed "
                        "(make test-deploy installs it)")
    out = export_gguf(model_dir, tmp_path / "model.gguf", dtype)
    assert_greedy_as_lmforge(model_dir, out, dtype, NEW_TOKENS, NEAR_TIE)


# llama.cpp's f16 matmul rounds the activations to f16 too, and a linear layer's state
# carries that rounding on: its f16 logits were 4e-3 to 2e-2 from lmforge's (scale 7.4;
# the f32 file's 1e-5 to 5e-4), and on interval-4 two of the nine runs left lmforge's
# tokens, each where lmforge's top two logits were 0.0003 and 0.031 apart (the 6-token
# prompt's 22nd token, the 70-token prompt's 21st); the other seven: all 24 tokens equal
NEAR_TIE = 0.05


# Where ours differs from the converter's on purpose: EOS is the chat template's
# end-of-turn token (as for every family), and a head under 32 features gets rope
# sections that fit it (the converter's [11, 11, 10, 0] make ggml abort there).
DIFFERENT_ON_PURPOSE = {"tokenizer.ggml.eos_token_id", "qwen35.rope.dimension_sections"}


def test_every_key_and_tensor_of_llama_cpps_converter_is_in_our_export(model_dir, tmp_path):
    """The same directory through llama.cpp's convert_hf_to_gguf.py --outtype f32
    --no-mtp and lmforge (``assert_as_converted``): every key of the converter's in ours
    with its value (but DIFFERENT_ON_PURPOSE; the rope sections only under a 32-feature
    head), and the same tensors, byte for byte."""
    keys, differing = assert_as_converted(model_dir, tmp_path, "qwen35", DIFFERENT_ON_PURPOSE)
    if keys["qwen35.attention.key_length"] >= 32:
        assert "qwen35.rope.dimension_sections" not in differing


@pytest.mark.parametrize("fields, message", [
    (dict(linear_value_head_dim=16), r"linear_value_head_dim \(16\) differs from "
     r"linear_key_head_dim \(8\)"),
    (dict(layer_types=[L] * 4), r"layer_types: every layer is linear_attention"),
    (dict(layer_types=[F] * 4), r"layer_types: every layer is full_attention"),
], ids=["value-head-dim", "all-linear", "all-full"])
def test_what_llama_cpp_cannot_compute_is_refused_in_one_line(tmp_path, fields, message):
    src = hf_model_dir(tmp_path / "model", "qwen3_5_text", **(LINEAR | fields))
    with pytest.raises(GGUFError, match=message) as refused:
        export_gguf(src, tmp_path / "model.gguf")
    text = str(refused.value)
    assert f"llama-cpp-python {LLAMA_CPP_PYTHON}" in text and "\n" not in text
    assert not (tmp_path / "model.gguf").exists()


def test_an_image_text_directorys_language_model_runs_in_llama_cpp(tmp_path):
    """A Hub-shaped Qwen3_5ForConditionalGeneration directory (the language model under
    model.language_model., a vision tower under model.visual.): its language model alone
    in the file, as the converter writes it, with lmforge's greedy tokens."""
    import gguf
    import transformers

    from helpers.real_tokenizers import save_tokenizer
    from lmforge.data.tokenizer import load_tokenizer

    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    src = tmp_path / "model"
    save_tokenizer("chatml", src)
    text = LINEAR | dict(
        vocab_size=load_tokenizer(src).vocab_size, hidden_size=64, intermediate_size=96,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        initializer_range=0.2)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                  out_hidden_size=64, patch_size=4, temporal_patch_size=2,
                  spatial_merge_size=2, num_position_embeddings=16)
    torch.manual_seed(3)
    model = transformers.Qwen3_5ForConditionalGeneration(
        transformers.Qwen3_5Config(text_config=text, vision_config=vision)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(PERTURBED):
                p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(src)
    out = export_gguf(src, tmp_path / "model.gguf", "f32")
    names = {t.name for t in gguf.GGUFReader(out).tensors}
    assert {n.split(".")[0] for n in names} == {"token_embd", "blk", "output_norm", "output"}
    ours = load_hf_model(src)
    prompts = seeded_prompts(ours.args.vocab_size)[:2]
    expected = [generate(ours, [p], NEW_TOKENS)[0].ids for p in prompts]
    assert greedy_tokens(out, prompts, NEW_TOKENS) == expected


@pytest.fixture
def lora_model(tmp_path):
    """interval-4's model with random LoRA adapters: (model, base directory)."""
    from lmforge.config import LoraConfig
    from lmforge.peft import apply_lora, lora_layers

    def adapted(targets: list[str]):
        base = _perturbed(hf_model_dir(tmp_path / "base", "qwen3_5_text", seed=3,
                                       **CASES["interval-4"]))
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
    from lmforge.export.gguf import export_gguf_lora
    from lmforge.peft import save_adapter

    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    model, base = lora_model(["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
                              "q_proj", "v_proj"])
    adapter = save_adapter(model, tmp_path / "adapter", base_model_path=str(base))
    base_gguf = export_gguf(base, tmp_path / "base.gguf", "f32")
    lora_gguf = export_gguf_lora(adapter, base, tmp_path / "lora.gguf")
    prompts = seeded_prompts(model.args.vocab_size)[:2]
    expected = [generate(model, [p], NEW_TOKENS)[0].ids for p in prompts]
    unadapted = load_hf_model(base)
    assert expected != [generate(unadapted, [p], NEW_TOKENS)[0].ids for p in prompts]
    assert greedy_tokens(base_gguf, prompts, NEW_TOKENS, lora_path=str(lora_gguf)) == expected


def test_a_lora_gguf_with_an_out_proj_adapter_is_refused_in_one_line(lora_model, tmp_path):
    """out_proj's value heads are its A's columns, which llama.cpp reads tiled and the
    export's hook (B's rows) cannot reorder: refused, nothing written."""
    from lmforge.export.gguf import export_gguf_lora
    from lmforge.peft import save_adapter

    model, base = lora_model(["in_proj_z", "out_proj"])
    adapter = save_adapter(model, tmp_path / "adapter", base_model_path=str(base))
    with pytest.raises(ValueError, match=r"out_proj\.weight: no GGUF form of a LoRA "
                                         r"adapter on out_proj: llama\.cpp's qwen35 "
                                         r"\(llama-cpp-python 0\.3\.36\)"):
        export_gguf_lora(adapter, base, tmp_path / "lora.gguf")
    assert not (tmp_path / "lora.gguf").exists()
