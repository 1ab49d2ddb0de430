"""``lmforge eval --objective``: a model (+ adapter) scored on preference pairs with the
trainer's formulas and TRL's metric names; an adapter's base is its reference, the same
as giving that base as --reference; a reference-free objective needs none."""
from __future__ import annotations

import json

import pytest
import torch

from helpers.preference_data import model_dir, pairs, write_pairs
from lmforge.cli import main
from lmforge.config import LoraConfig
from lmforge.models.hf import load_hf_model
from lmforge.models.preference import METRICS
from lmforge.peft import apply_lora, lora_layers, save_adapter


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval-pairs")
    model = model_dir(root)
    data = write_pairs(root / "pairs.jsonl", pairs(10))
    adapted = load_hf_model(model)
    apply_lora(adapted, LoraConfig(enabled=True, rank=4, targets="all-linear"))
    g = torch.Generator().manual_seed(0)
    for layer in lora_layers(adapted).values():
        layer.lora_b.data = torch.randn(layer.lora_b.shape, generator=g) * 0.2
    save_adapter(adapted, root / "adapter", base_model_path=str(model))
    return model, data, root / "adapter"


def _eval(capsys, *argv) -> dict:
    assert main(["eval", "--seq-len", "48", "--batch-size", "3", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_an_adapters_base_is_its_reference_and_the_metrics_carry_trls_names(assets, capsys):
    model, data, adapter = assets
    off = _eval(capsys, "--model", str(model), "--adapter", str(adapter), "--data", str(data),
                "--objective", "dpo")
    base = _eval(capsys, "--model", str(model), "--adapter", str(adapter), "--reference",
                 str(model), "--data", str(data), "--objective", "dpo")
    assert off["pairs"] == 10 and set(METRICS) <= set(off)
    for key in ("loss", *METRICS):
        assert off[key] == pytest.approx(base[key], rel=1e-6, abs=1e-7), key
    assert off["rewards/margins"] == pytest.approx(
        off["rewards/chosen"] - off["rewards/rejected"], abs=1e-6)


def test_simpo_needs_no_reference_and_dpo_without_one_is_refused(assets, capsys):
    model, data, _ = assets
    simpo = _eval(capsys, "--model", str(model), "--data", str(data), "--objective", "simpo")
    assert simpo["loss"] > 0
    assert main(["eval", "--model", str(model), "--data", str(data), "--objective", "dpo"]) == 2
    assert "--reference: dpo compares with a reference model" in capsys.readouterr().err
