"""Extending a model's context as users do it: model.rope_theta raised and
model.rope_scaling (YaRN, linear) set over a model directory that says otherwise, then
training on windows longer than its positions. The run's hf/ export carries the new RoPE
in config.json, and transformers computes our logits from it (1e-5) past the original
length; a run longer than the model's positions without an extension is refused naming
both fields, before any compute."""
from __future__ import annotations

import json

import pytest
import torch

from helpers.hf_models import hf_model_dir, load_reference
from lmforge.cli import main
from lmforge.config import ConfigError, load_config
from lmforge.job import resolve
from lmforge.models.hf import load_hf_model
from lmforge.train.loop import train

ORIGINAL = 32  # the base model's positions


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = hf_model_dir(tmp_path_factory.mktemp("ctx") / "base", tokenizer="llama3", seed=3,
                        max_position_embeddings=ORIGINAL)
    (root.parent / "corpus.txt").write_text(
        "\n\n".join(f"document {i}: " + " ".join(["the long context"] * 30) for i in range(20)))
    return root


def _overrides(base, out, *extra) -> list[str]:
    return [f"model.init_from={base}", "data.kind=text",
            f"data.path={base.parent / 'corpus.txt'}", "data.seq_len=96",
            "data.micro_batch_size=1", "data.eval_fraction=0", "train.max_steps=2",
            "train.sample_tokens=1", "train.device=cpu", "train.progress_bar=false",
            f"train.output_dir={out}", *extra]


@pytest.mark.parametrize("rope", [
    "{rope_type: yarn, factor: 4.0}",
    "{rope_type: linear, factor: 4.0}"])
def test_an_extended_run_exports_a_config_transformers_computes_our_logits_from(
        base, tmp_path, rope):
    out = tmp_path / "run"
    train(load_config(None, _overrides(base, out, f"model.rope_scaling={rope}",
                                       "model.rope_theta=80000.0")))
    config = json.loads((out / "hf" / "config.json").read_text())
    scaling = config.get("rope_scaling") or config.get("rope_parameters")
    assert scaling["rope_type"] == rope.split(",")[0].split()[-1] and scaling["factor"] == 4.0
    assert config["max_position_embeddings"] == 4 * ORIGINAL  # followed the extension
    theta = config.get("rope_theta") or config["rope_parameters"]["rope_theta"]
    assert theta == 80000.0
    ours = load_hf_model(out / "hf").eval()
    theirs = load_reference(out / "hf")
    tokens = torch.randint(0, ours.args.vocab_size, (1, 3 * ORIGINAL),
                           generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, rtol=1e-5, atol=1e-5)


def test_a_sequence_past_the_models_positions_is_refused_naming_both_fields(base, tmp_path,
                                                                            capsys):
    assert main(["train", *_overrides(base, tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "data.seq_len: 96 exceeds the model's max_seq_len (32, model.max_seq_len)" in err
    assert "model.rope_scaling" in err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("value,match", [
    ("{rope_type: dynamic, factor: 2.0}", "model.rope_scaling.rope_type: 'dynamic' is not one of"),
    ("yarn", "model.rope_scaling: 'yarn' is not a mapping"),
    ("{rope_type: yarn}", "model.rope_scaling: factor")])
def test_a_bad_rope_scaling_is_refused_naming_the_field(base, tmp_path, value, match):
    cfg = load_config(None, _overrides(base, tmp_path / "r", f"model.rope_scaling={value}"))
    with pytest.raises(ConfigError, match=match):
        resolve(cfg)
