"""PEFT-format adapters against peft itself: same logits both ways, round trips, merged
exports equal to the unmerged model."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from lmforge.models.hf import load_hf_model  # noqa: E402
from helpers.hf_models import load_reference  # noqa: E402
from lmforge.peft import (AdapterError, apply_lora, export_merged, load_adapter,  # noqa: E402
                          lora_layers, merge_lora, save_adapter)

VARIANTS = {
    "qv_r4": dict(targets=["q_proj", "v_proj"], rank=4, alpha=8.0, rslora=False),
    "all_linear_rslora": dict(targets="all-linear", rank=8, alpha=16.0, rslora=True),
}


def ours_with_adapter(lib, path, seed=1, **lora):
    model = load_hf_model(path).eval()
    apply_lora(model, lib.lora_cfg(**lora))
    lib.randomize_adapters(model, seed=seed)
    return model


def hf_logits(model, x):
    with torch.no_grad():
        return model(x).logits


@pytest.mark.parametrize("variant", VARIANTS)
@torch.no_grad()
def test_lmforge_adapter_loads_in_peft_with_the_same_logits(lib, hf_llama_dir, tmp_path,
                                                             variant):
    hf_model, path = hf_llama_dir
    ours = ours_with_adapter(lib, path, **VARIANTS[variant])
    out = save_adapter(ours, tmp_path / "adapter", base_model_path=str(path))
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(path)
    assert config["r"] == VARIANTS[variant]["rank"]
    assert config["lora_alpha"] == VARIANTS[variant]["alpha"]
    assert config["use_rslora"] is VARIANTS[variant]["rslora"]
    x = lib.tokens()
    base = hf_logits(hf_model, x)
    peft_model = peft.PeftModel.from_pretrained(hf_model, out).eval()
    reference = hf_logits(peft_model, x)
    assert lib.max_rel_err(reference, base) > 1e-3  # the adapter matters
    assert lib.max_rel_err(ours(x), reference) < 1e-5


@pytest.mark.parametrize("variant", VARIANTS)
@torch.no_grad()
def test_peft_adapter_loads_here_with_the_same_logits(lib, hf_llama_dir, tmp_path, variant):
    hf_model, path = hf_llama_dir
    v = VARIANTS[variant]
    targets = "all-linear" if v["targets"] == "all-linear" else v["targets"]
    peft_model = peft.get_peft_model(hf_model, peft.LoraConfig(
        r=v["rank"], lora_alpha=v["alpha"], target_modules=targets, use_rslora=v["rslora"],
        init_lora_weights=False)).eval()  # random B: the adapter changes the logits
    peft_model.save_pretrained(tmp_path / "peft")
    x = lib.tokens()
    reference = hf_logits(peft_model, x)

    ours = load_hf_model(path).eval()
    before = ours(x)
    cfg = load_adapter(ours, tmp_path / "peft")
    assert cfg.rank == v["rank"] and cfg.alpha == v["alpha"] and cfg.rslora == v["rslora"]
    assert lib.max_rel_err(before, reference) > 1e-3  # the adapter matters
    assert lib.max_rel_err(ours(x), reference) < 1e-5


def test_adapters_round_trip_in_both_directions(lib, hf_llama_dir, tmp_path):
    hf_model, path = hf_llama_dir
    # lmforge -> disk -> lmforge
    ours = ours_with_adapter(lib, path, targets="all-linear")
    save_adapter(ours, tmp_path / "a")
    again = load_hf_model(path)
    load_adapter(again, tmp_path / "a")
    for name, layer in lora_layers(ours).items():
        other = again.get_submodule(name)
        assert torch.equal(layer.lora_a, other.lora_a) and torch.equal(layer.lora_b, other.lora_b)
    # peft -> disk -> lmforge -> disk: the same tensors under the same names
    peft_model = peft.get_peft_model(hf_model, peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["k_proj", "down_proj"], init_lora_weights=False))
    peft_model.save_pretrained(tmp_path / "p")
    model = load_hf_model(path)
    load_adapter(model, tmp_path / "p")
    save_adapter(model, tmp_path / "p2")
    theirs = load_file(tmp_path / "p" / "adapter_model.safetensors")
    mine = load_file(tmp_path / "p2" / "adapter_model.safetensors")
    assert theirs.keys() == mine.keys()
    assert all(torch.equal(theirs[k], mine[k]) for k in theirs)


@torch.no_grad()
def test_rank_and_alpha_patterns_written_by_peft_load(lib, hf_llama_dir, tmp_path):
    hf_model, path = hf_llama_dir
    peft_model = peft.get_peft_model(hf_model, peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], rank_pattern={"v_proj": 2},
        alpha_pattern={"v_proj": 32}, init_lora_weights=False)).eval()
    peft_model.save_pretrained(tmp_path / "p")
    ours = load_hf_model(path).eval()
    load_adapter(ours, tmp_path / "p")
    v = ours.get_submodule("layers.0.attention.v_proj")
    assert (v.rank, v.alpha) == (2, 32.0)
    x = lib.tokens()
    assert lib.max_rel_err(ours(x), hf_logits(peft_model, x)) < 1e-5
    save_adapter(ours, tmp_path / "again")  # written back as patterns peft understands
    reloaded = peft.PeftModel.from_pretrained(
        make_base(lib, tmp_path), tmp_path / "again").eval()
    assert lib.max_rel_err(ours(x), hf_logits(reloaded, x)) < 1e-5


def make_base(lib, tmp_path):
    return load_reference(tmp_path / "base")


@torch.no_grad()
def test_merged_export_equals_the_unmerged_model(lib, hf_llama_dir, tmp_path):
    _, path = hf_llama_dir
    ours = ours_with_adapter(lib, path, targets="all-linear")
    x = lib.tokens()
    unmerged = ours(x)
    export_merged(ours, tmp_path / "merged")
    assert not any(m.merged for m in lora_layers(ours).values())  # model left as it was
    merged = load_hf_model(tmp_path / "merged").eval()
    assert lib.max_rel_err(merged(x), unmerged) < 1e-5
    hf_merged = load_reference(tmp_path / "merged")
    assert lib.max_rel_err(hf_logits(hf_merged, x), unmerged) < 1e-5
    # merging in place, then exporting, writes the same weights
    merge_lora(ours)
    export_merged(ours, tmp_path / "merged2")
    a = load_file(tmp_path / "merged" / "model.safetensors")
    b = load_file(tmp_path / "merged2" / "model.safetensors")
    assert all(torch.allclose(a[k], b[k], rtol=0, atol=1e-6) for k in a)


def test_tied_embeddings_model_exports_and_saves(lib, tmp_path):
    path = lib.make_hf_llama(tmp_path / "tied", tie_word_embeddings=True)[1]
    ours = ours_with_adapter(lib, path, targets="all-linear")
    x = lib.tokens()
    with torch.no_grad():
        unmerged = ours(x)
        export_merged(ours, tmp_path / "merged")
        merged = load_hf_model(tmp_path / "merged").eval()
        assert lib.max_rel_err(merged(x), unmerged) < 1e-5
    assert merged.output.weight is merged.tok_embeddings.weight


def test_unsupported_adapters_are_refused_with_the_reason(lib, hf_llama_dir, tmp_path):
    _, path = hf_llama_dir
    ours = ours_with_adapter(lib, path)
    save_adapter(ours, tmp_path / "a")
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())

    def write(name, **changes):
        d = tmp_path / name
        d.mkdir()
        (d / "adapter_config.json").write_text(json.dumps({**config, **changes}))
        sd = load_file(tmp_path / "a" / "adapter_model.safetensors")
        save_file(sd, str(d / "adapter_model.safetensors"))
        return d

    for name, changes, message in [
            ("dora", {"use_dora": True}, "use_dora = True is not supported"),
            ("ia3", {"peft_type": "IA3"}, "only LORA"),
            ("bias", {"bias": "all"}, "bias = 'all' is not supported")]:
        with pytest.raises(AdapterError, match=message):
            load_adapter(load_hf_model(path), write(name, **changes))
    bad = write("extra")
    sd = load_file(bad / "adapter_model.safetensors")
    sd["base_model.model.lm_head.modules_to_save.weight"] = torch.zeros(2, 2)
    save_file(sd, str(bad / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="keys lmforge cannot load.*lm_head"):
        load_adapter(load_hf_model(path), bad)
    wrong_rank = load_hf_model(path)
    apply_lora(wrong_rank, lib.lora_cfg(rank=2))
    with pytest.raises(AdapterError, match="rank 4 but the model's LoRA layer .* rank 2"):
        load_adapter(wrong_rank, tmp_path / "a")
    with pytest.raises(AdapterError, match="exists and is not an adapter directory"):
        (tmp_path / "other").mkdir()
        (tmp_path / "other" / "x.txt").write_text("keep me")
        save_adapter(ours, tmp_path / "other")
