"""configs/qwen3.5-9b-lora.yaml (docs/hybrid-attention.md): on a model directory of the
real shape (Qwen3.5-9B's config.json and a chat tokenizer; a dry run reads no weights)
it passes `lmforge train --dry-run` on one GPU, and `lmforge estimate` puts it under an
80 GB GPU."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.real_tokenizers import save_tokenizer
from lmforge.cli import main
from lmforge.config import load_config
from lmforge.models.registry import PRESETS, family_of
from lmforge.perf.estimate import GiB, estimate_memory
from lmforge.perf.estimate_setup import setup_from_config

RECIPE = Path(__file__).resolve().parents[2] / "configs" / "qwen3.5-9b-lora.yaml"
PRESET = "qwen3.5-9b"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("qwen3.5-recipe")
    model = root / PRESET
    model.mkdir()
    save_tokenizer("chatml", model)
    args = PRESETS[PRESET]
    (model / "config.json").write_text(json.dumps(family_of(args).hf_config(args)))
    chat = root / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "What is 3 + 4?"},
                                             {"role": "assistant", "content": "7"}]}) + "\n")
    return [f"model.init_from={model}", f"data.path={chat}", f"data.eval_path={chat}"]


def test_the_qwen3_5_recipe_passes_a_dry_run(inputs, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("LMFORGE_DEBUG", raising=False)
    out = tmp_path / "run"
    code = main(["train", str(RECIPE), *inputs, f"train.output_dir={out}",
                 "train.device=cuda", "--dry-run"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "dry run: the config is valid" in printed
    assert "in_proj_qkv" in printed  # all-linear reaches the Gated DeltaNet's projections
    assert not out.exists()


def test_the_qwen3_5_recipe_fits_an_80_gb_gpu_by_the_estimate(inputs, capsys):
    cfg = load_config(RECIPE, ["model.init_from=null", f"model.preset={PRESET}",
                               f"model.vocab_size={PRESETS[PRESET].vocab_size}"])
    setup = setup_from_config(cfg, device="cuda")
    assert setup.lora is not None and setup.cfg.train.activation_checkpointing == "full"
    total = estimate_memory(setup).total_bytes
    assert total < 80 * GiB
    code = main(["estimate", str(RECIPE), *inputs, "--device", "cuda", "--json"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert json.loads(printed)["total_gib"] == pytest.approx(total / GiB, rel=1e-6)
