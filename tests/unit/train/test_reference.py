"""The precomputed reference pass (train/reference.py) on its own: its progress lines, a
starting model that gives NaN refused with nothing written, an earlier pass read back
rather than scored again, and what names the starting model. (The damaged reference/ of
a resumed run: tests/integration/test_bad_inputs_reference.py.)"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from helpers.preference_data import model_dir, pairs, write_pairs
from lmforge.config import load_config
from lmforge.data.preference import PreferenceDataset
from lmforge.data.tokenizer import load_tokenizer
from lmforge.models.hf import load_hf_model
from lmforge.models.preference import PreferenceParams
from lmforge.train import reference as R
from lmforge.train.preference import Preference

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("reference")
    model = model_dir(root)
    data = write_pairs(root / "pairs.jsonl", pairs(12))
    dataset = PreferenceDataset(data, load_tokenizer(model), "auto", 48,
                                cache_dir=root / "cache")
    cfg = load_config(None, [f"model.init_from={model}", "data.kind=preference",
                             f"data.path={data}", "train.reference=precomputed",
                             "train.progress_bar=false"])
    return model, dataset, cfg


def _run(model, dataset, cfg, out: Path, logging: bool = True) -> None:
    tm = SimpleNamespace(objective=Preference("dpo", PreferenceParams(), "batch"),
                         parts=[model], loss_chunk_tokens=0,
                         dims=SimpleNamespace(dp_rank=0, dp=1, mesh=None))
    loader = SimpleNamespace(dataset=dataset, sampler=SimpleNamespace(micro_batch_size=2))
    R.precompute_reference(tm, cfg, {"train": loader, "eval": None}, out, CPU,
                           contextlib.nullcontext, logging)


def test_the_pass_says_how_far_it_is_about_ten_times_with_elapsed_and_eta(capsys):
    cfg = load_config(None, ["train.progress_bar=false"])
    progress = R._PassProgress(cfg, True, "training", 100, 4)
    for batch in range(1, 26):
        progress.update(batch, batch * 4)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("reference: scoring 100 training pairs with the starting "
                               "model"), lines
    counts = [int(line.split()[1].split("/")[0]) for line in lines[1:]]
    assert counts == sorted(counts) and counts[-1] == 100 and 9 <= len(counts) <= 13, lines
    assert all("elapsed 0:00:0" in line and "ETA" in line for line in lines[1:]), lines


def test_other_ranks_say_nothing(capsys):
    progress = R._PassProgress(load_config(None, []), False, "training", 10, 2)
    for batch in range(1, 6):
        progress.update(batch, batch * 2)
    assert capsys.readouterr().out == ""


def test_on_a_terminal_the_pass_has_a_bar(capsys):
    cfg = load_config(None, ["train.progress_bar=true"])
    progress = R._PassProgress(cfg, True, "held-out", 10, 4)
    for batch in range(1, 4):
        progress.update(batch, batch * 4)  # the last passes the count: capped at 10
    captured = capsys.readouterr()
    assert captured.out.count("\n") == 1  # the opening line; no per-batch lines
    assert "10/10" in captured.err and progress.bar.n == 10


def test_a_starting_model_that_gives_nan_is_refused_with_nothing_written(setup, tmp_path):
    model_path, dataset, cfg = setup
    model = load_hf_model(model_path)
    with torch.no_grad():
        model.norm.weight.fill_(float("nan"))
    with pytest.raises(ValueError, match=r"^model\.init_from=\S+: the starting model gives \d+ NaN/Inf "
                                         r"reference log-probabilities on the training "
                                         r"pairs of .*pairs\.jsonl; nothing written to"):
        _run(model, dataset, cfg, tmp_path)
    assert not (tmp_path / R.REFERENCE_DIR).exists()


def test_an_earlier_pass_is_read_back_not_scored_again(setup, tmp_path, monkeypatch, capsys):
    model_path, dataset, cfg = setup
    model = load_hf_model(model_path)
    _run(model, dataset, cfg, tmp_path)
    first = dataset.reference.copy()
    manifest = json.loads((tmp_path / R.REFERENCE_DIR / "checksums.json").read_text())
    (name, entry), = manifest["files"].items()
    assert entry["shape"] == list(first.shape) and entry["dtype"] == "float64"
    assert entry["model"]["model.init_from"] == str(Path(model_path).resolve())
    assert entry["data"]["pairs"] == len(dataset.rows)

    def no_second_pass(*args, **kwargs):
        raise AssertionError("scored again")
    monkeypatch.setattr(R, "_score", no_second_pass)
    capsys.readouterr()
    _run(model, dataset, cfg, tmp_path)
    np.testing.assert_array_equal(dataset.reference, first)
    assert f"scored before, read from {tmp_path / R.REFERENCE_DIR / name}" in (
        capsys.readouterr().out)


def test_only_the_logging_rank_writes_and_speaks(setup, tmp_path, capsys):
    model_path, dataset, cfg = setup
    _run(load_hf_model(model_path), dataset, cfg, tmp_path, logging=False)
    assert capsys.readouterr().out == ""
    assert not (tmp_path / R.REFERENCE_DIR).exists()
    assert np.isfinite(dataset.reference).all()


def test_the_starting_model_is_named_by_its_weights_not_its_kernels(tmp_path):
    base = ["data.kind=preference", "train.seed=3"]
    random = R.starting_model(load_config(None, base))
    assert random["train.seed"] == 3 and "model.attention" not in random
    assert random == R.starting_model(load_config(None, [*base, "model.attention=flex"]))
    (tmp_path / "m").mkdir()
    here = R.starting_model(load_config(None, [*base, f"model.init_from={tmp_path}/./m"]))
    assert here["model.init_from"] == str(tmp_path / "m") and "train.seed" not in here
