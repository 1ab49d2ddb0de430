"""Qwen3-Next exported to GGUF (models/qwen3_next/gguf.py, llama.cpp's qwen3next) and run
in llama.cpp itself, on tiny transformers-made Qwen3NextForCausalLM directories (Gated
DeltaNet and gated full-attention layers, experts and a gated shared expert on every
layer; A_log, dt_bias and the norms perturbed, as transformers starts them at
constants): llama.cpp's greedy tokens after prompts of 1, 6 and 70 tokens (the last past a
64-token chunk, fed in ubatches of 32) equal lmforge's and transformers' from the f32
export made by `lmforge export`, and lmforge's from the f16 one (up to a near tie, of the
logits or of a router's choice, that llama.cpp's f16 rounding of activations flips); the
f32 file's tensors are the converter's, byte for byte, and its keys too but EOS; the
checkpoints' multi-token-prediction layers are left out; a LoRA GGUF on its base's gives
the adapted model's tokens; what llama.cpp's qwen3next cannot compute (or a LoRA GGUF
cannot place: an in_proj_qkvz adapter), or a gguf package too old to name it, is refused
in one line naming the architecture and the version."""
from __future__ import annotations

import pytest

from helpers.llama_cpp_runs import (assert_as_converted, assert_greedy_as_lmforge,
                                    greedy_tokens, hybrid_dir, lmforge_export, prompts)
from lmforge.export.gguf import GGUFError, export_gguf
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
    # key head (qwen3next repeats each key head in place: the checkpoint's order)
    "interval-4": SPARSE,
    # a pattern read as given, full first, tied embeddings, one value head per key head
    "given-pattern-tied": SPARSE | dict(layer_types=[F, L, L, F], tie_word_embeddings=True,
                                        linear_num_value_heads=2),
}


@pytest.fixture(params=sorted(CASES), scope="module")
def model_dir(request, tmp_path_factory):
    # (a neutral directory name: llama.cpp keys special-token rules on general.name)
    root = tmp_path_factory.mktemp(request.param) / "model"
    return hybrid_dir(root, "qwen3_next", **CASES[request.param])


# llama.cpp's f16 matmul rounds the activations to f16 too, and a linear layer's state
# carries that rounding on: its f16 logits were mostly 4e-3 to 9e-2 from lmforge's (scale
# 7), and 0.8 after a one-token prompt whose routing at layer 3 was 0.0002 (probability)
# from a tie. Of the six f16 runs (2 cases, 3 prompts), three left lmforge's tokens: two
# where lmforge's top two logits were 0.004 and 0.032 apart, one where a router's last
# chosen expert led the next by 0.00012 (logits then 0.18 apart)
NEAR_TIE = 0.05
ROUTER_TIE = 1e-3


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_llama_cpp_greedy_tokens_equal_lmforges_and_transformers(model_dir, tmp_path, dtype):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed "
                        "(make test-deploy installs it)")
    out = lmforge_export(model_dir, tmp_path / "model.gguf", dtype)
    assert_greedy_as_lmforge(model_dir, out, dtype, NEW_TOKENS, NEAR_TIE, ROUTER_TIE)


def test_every_key_and_tensor_of_llama_cpps_converter_is_in_our_export(model_dir, tmp_path):
    """The same directory through llama.cpp's convert_hf_to_gguf.py --outtype f32
    --no-mtp and lmforge: every key of the converter's in ours with its value (but EOS,
    the chat template's end-of-turn token in ours, as for every family), and the same
    tensors (in_proj_qkvz split into attn_qkv and attn_gate, the experts stacked), byte
    for byte."""
    assert_as_converted(model_dir, tmp_path, "qwen3next")


def test_the_multi_token_prediction_layers_are_left_out(tmp_path):
    """The released checkpoints hold multi-token-prediction layers (mtp.*), which lmforge
    does not build: the export of a directory with them is the export without them, byte
    for byte (the converter's --no-mtp)."""
    import shutil

    import gguf
    import numpy as np
    import torch
    from safetensors.torch import load_file, save_file

    src = hybrid_dir(tmp_path / "model", "qwen3_next", **SPARSE)
    with_mtp = tmp_path / "with-mtp"
    shutil.copytree(src, with_mtp)
    weights = load_file(src / "model.safetensors")
    mtp = {"mtp.fc.weight": torch.randn(64, 128), "mtp.norm.weight": torch.randn(64),
           "mtp.layers.0.mlp.experts.0.up_proj.weight": torch.randn(24, 64)}
    save_file(weights | mtp, with_mtp / "model.safetensors", metadata={"format": "pt"})
    plain = gguf.GGUFReader(export_gguf(src, tmp_path / "plain.gguf", "f32")).tensors
    ours = {t.name: t for t in gguf.GGUFReader(
        export_gguf(with_mtp, tmp_path / "with-mtp.gguf", "f32")).tensors}
    assert ours.keys() == {t.name for t in plain}
    assert all(np.array_equal(ours[t.name].data, t.data) for t in plain)


@pytest.mark.parametrize("fields, message", [
    (dict(mlp_only_layers=[1]), r"layers \[1\] have a dense MLP \(mlp_only_layers / "
     r"decoder_sparse_step\), and llama\.cpp's qwen3next has experts in every layer"),
    (dict(norm_topk_prob=False), r"norm_topk_prob is false, and llama\.cpp's qwen3next "
     r"always rescales"),
    (dict(linear_value_head_dim=16), r"linear_value_head_dim \(16\) differs from "
     r"linear_key_head_dim \(8\), and llama\.cpp's qwen3next"),
    (dict(layer_types=[L] * 4), r"layer_types: every layer is linear_attention, and "
     r"llama\.cpp's qwen3next"),
    (dict(layer_types=[F] * 4), r"layer_types: every layer is full_attention"),
], ids=["dense-layer", "raw-top-k", "value-head-dim", "all-linear", "all-full"])
def test_what_llama_cpp_cannot_compute_is_refused_in_one_line(tmp_path, fields, message):
    """(Each measured: llama.cpp 0.3.36 finds no tensor for a dense layer, gives other
    tokens for raw top-k weights, and aborts on a model of one kind of layer.)"""
    src = hybrid_dir(tmp_path / "model", "qwen3_next", **(SPARSE | fields))
    with pytest.raises(GGUFError, match=message) as refused:
        export_gguf(src, tmp_path / "model.gguf")
    text = str(refused.value)
    assert f"llama-cpp-python {LLAMA_CPP_PYTHON}" in text and "\n" not in text
    assert not (tmp_path / "model.gguf").exists()


def test_a_gguf_package_without_the_architecture_is_refused_in_one_line(tmp_path,
                                                                        monkeypatch):
    """An installed gguf package older than llama.cpp's qwen3next: refused before the
    weights are read, naming the architecture and the package's version."""
    import gguf
    from importlib.metadata import version

    src = hybrid_dir(tmp_path / "model", "qwen3_next", **SPARSE)
    monkeypatch.setattr(gguf, "MODEL_ARCH_NAMES", {
        member: name for member, name in gguf.MODEL_ARCH_NAMES.items() if name != "qwen3next"})
    with pytest.raises(GGUFError) as refused:
        export_gguf(src, tmp_path / "model.gguf")
    text = str(refused.value)
    assert f"the installed gguf package ({version('gguf')}) does not know llama.cpp's " \
           f"qwen3next architecture" in text and "\n" not in text
    assert not (tmp_path / "model.gguf").exists()


def test_a_lora_gguf_on_its_base_gives_the_adapted_models_tokens(tmp_path):
    """Adapters on the linear layers' out_proj (its value heads in the checkpoint's order,
    as qwen3next reads them) and on the full layers' q and v."""
    import torch

    from lmforge.config import LoraConfig
    from lmforge.export.gguf import export_gguf_lora
    from lmforge.peft import apply_lora, lora_layers, save_adapter

    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    base = hybrid_dir(tmp_path / "base", "qwen3_next", **CASES["interval-4"])
    model = load_hf_model(base)
    apply_lora(model, LoraConfig(enabled=True, rank=4, alpha=8.0,
                                 targets=["out_proj", "q_proj", "v_proj"]))
    g = torch.Generator().manual_seed(0)
    for layer in lora_layers(model).values():  # adapters that change the tokens
        layer.lora_b.data = torch.randn(layer.lora_b.shape, generator=g) * 0.3
    adapter = save_adapter(model, tmp_path / "adapter", base_model_path=str(base))
    base_gguf = export_gguf(base, tmp_path / "base.gguf", "f32")
    lora_gguf = export_gguf_lora(adapter, base, tmp_path / "lora.gguf")
    asked = prompts(model.args.vocab_size)[:2]
    expected = [generate(model, [p], NEW_TOKENS)[0].ids for p in asked]
    unadapted = load_hf_model(base)
    assert expected != [generate(unadapted, [p], NEW_TOKENS)[0].ids for p in asked]
    assert greedy_tokens(base_gguf, asked, NEW_TOKENS, lora_path=str(lora_gguf)) == expected


def test_an_adapter_on_the_fused_in_proj_qkvz_is_refused_in_one_line():
    """llama.cpp reads in_proj_qkvz as two tensors (attn_qkv, attn_gate), and a LoRA
    GGUF's adapter is on one: the export's hook refuses it rather than write it misplaced."""
    import torch

    from lmforge.models.qwen3_next import FAMILY

    name = "model.layers.0.linear_attn.in_proj_qkvz.weight"
    with pytest.raises(ValueError, match=r"in_proj_qkvz\.weight: no GGUF form of a LoRA "
                                         r"adapter on in_proj_qkvz: llama\.cpp's qwen3next "
                                         r"\(llama-cpp-python 0\.3\.36\)") as refused:
        FAMILY.gguf.rows_as_gguf(name, torch.zeros(96, 4), FAMILY.presets["qwen3-next-debug"])
    assert "\n" not in str(refused.value)
