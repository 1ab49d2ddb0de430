"""The checks every family's tests run against transformers on a random model saved to a
directory: equal logits, equal greedy decodes, a bit-identical export that transformers
loads with equal logits, and LoRA adapters that peft loads (and a merged export that
transformers loads) with our logits."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers.hf_models import load_reference
from lmforge.config import LoraConfig
from lmforge.models.generate import generate
from lmforge.models.hf import load_hf_model, save_hf_model
from lmforge.peft import apply_lora, export_merged, lora_layers, save_adapter


def tokens(vocab: int, seq: int, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def assert_logits_equal(hf_model, path: Path, x: torch.Tensor) -> None:
    """Our model loaded from ``path`` gives transformers' logits (fp32, 1e-5)."""
    torch.testing.assert_close(load_hf_model(path)(x), hf_model(x).logits,
                               rtol=1e-5, atol=1e-5)


def assert_greedy_decode_equal(hf_model, path: Path, prompt: list[int], new: int) -> None:
    """``new`` greedy tokens after ``prompt``: ours (the batched decoder, alone and
    left-padded between a shorter and a longer prompt) are transformers'."""
    model = load_hf_model(path)
    theirs = hf_model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                               min_new_tokens=new, pad_token_id=0)[0, len(prompt):].tolist()
    assert generate(model, [prompt], new)[0].ids == theirs
    batch = [prompt[:2], prompt, prompt[::-1] * 2]
    assert generate(model, batch, new)[1].ids == theirs


@torch.no_grad()
def assert_export_round_trip(hf_model, path: Path, out: Path, x: torch.Tensor,
                             keys: tuple = ()) -> dict:
    """Our export of the model at ``path`` holds the same tensors bit for bit, repeats
    config.json's ``keys``, and loads in transformers (the same attention implementation)
    with equal logits on ``x``. Returns the exported config.json."""
    save_hf_model(load_hf_model(path), out)
    original, exported = load_file(path / "model.safetensors"), load_file(
        out / "model.safetensors")
    assert original.keys() == exported.keys()
    assert all(torch.equal(original[k], exported[k]) for k in original)
    before = json.loads((path / "config.json").read_text())
    after = json.loads((out / "config.json").read_text())
    for key in keys:
        assert after.get(key) == before.get(key), key
    reloaded = load_reference(out)
    assert reloaded.config._attn_implementation == hf_model.config._attn_implementation
    assert torch.equal(reloaded(x).logits, hf_model(x).logits)
    return after


@torch.no_grad()
def assert_lora_round_trip(hf_model, path: Path, out: Path, x: torch.Tensor,
                           targets="all-linear", tolerance: float = 1e-5,
                           merged_tolerance: float = 1e-4) -> dict:
    """Adapters on ``targets`` with non-zero weights: peft loads ours on transformers'
    model with our logits (to ``tolerance``), and the merged export, loaded by
    transformers, gives them again (to ``merged_tolerance``). Returns our model's adapted
    layers by name."""
    peft = pytest.importorskip("peft")
    ours = load_hf_model(path).eval()
    apply_lora(ours, LoraConfig(enabled=True, rank=4, alpha=8.0, targets=targets))
    g = torch.Generator().manual_seed(2)
    for name, p in ours.named_parameters():  # fresh adapters are a no-op (B = 0)
        if name.endswith(("lora_a", "lora_b")):  # (linear layers' and the experts')
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    adapter = save_adapter(ours, out / "adapter", base_model_path=str(path))
    merged = export_merged(ours, out / "merged", dtype=torch.float32)
    base = hf_model(x).logits
    with_adapter = peft.PeftModel.from_pretrained(hf_model, adapter).eval()
    reference = with_adapter(x).logits
    with_adapter.unload()  # give the caller's model back without adapters
    assert (reference - base).abs().max() > 1e-3  # the adapter matters
    torch.testing.assert_close(ours(x), reference, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(load_reference(merged)(x).logits, reference,
                               rtol=merged_tolerance, atol=merged_tolerance)
    return lora_layers(ours)


@torch.no_grad()
def assert_image_text_round_trip(hf_model, path: Path, out: Path, x: torch.Tensor) -> None:
    """An image-text directory (Qwen3.5's, Qwen3.5-MoE's: the language model under
    model.language_model., a vision tower under model.visual.): its language model loads
    with transformers' text-only logits (1e-5 of their scale), and the export holds every
    tensor of the original, the vision tower's bit for bit, with its config, so
    transformers loads the image-text model again with the same logits."""
    want = hf_model(input_ids=x).logits
    ours = load_hf_model(path).eval()
    assert ours.args.vision_from == str(path.resolve())
    assert (ours(x) - want).abs().max() <= 1e-5 * want.abs().max()
    save_hf_model(ours, out)
    original, exported = load_file(path / "model.safetensors"), load_file(
        out / "model.safetensors")
    assert original.keys() == exported.keys()
    assert any(k.startswith("model.visual.") for k in exported)
    assert all(torch.equal(original[k], exported[k]) for k in original)
    before = json.loads((path / "config.json").read_text())
    after = json.loads((out / "config.json").read_text())
    for key in ("vision_config", "text_config", "architectures"):
        assert after[key] == before[key], key
    reloaded = type(hf_model).from_pretrained(out).eval()
    assert torch.equal(reloaded(input_ids=x).logits, want)

