"""The dialogue-summarisation generator of examples/dialogsum: deterministic, well-formed,
summaries grounded in their dialogues."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "examples" / "dialogsum" / "make_data.py"


@pytest.fixture(scope="module")
def make_data():
    spec = importlib.util.spec_from_file_location("dialogsum_make_data", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generator_is_deterministic_and_well_formed(make_data, tmp_path):
    for out in ("a", "b"):
        make_data.main(["--out", str(tmp_path / out), "--train", "40", "--validation", "10",
                        "--seed", "3"])
    for name in ("train.jsonl", "validation.jsonl", "pretrain/train.txt",
                 "pretrain/validation.txt"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    train = [json.loads(x) for x in (tmp_path / "a" / "train.jsonl").read_text().splitlines()]
    valid = [json.loads(x) for x in (tmp_path / "a" / "validation.jsonl").read_text().splitlines()]
    assert len(train) == 40 and len(valid) == 10
    for r in train + valid:
        assert r["prompt"].startswith("Dialogue:\n") and r["prompt"].endswith("\nSummary:")
        assert r["response"].endswith(".") and "\n" not in r["response"]
        speakers = {line.split(":")[0] for line in r["prompt"].splitlines()[1:-1]}
        assert len(speakers) == 2
        assert any(s in r["response"] for s in speakers) or (
            r["response"].startswith("A technician"))  # the one summary without a name
    pretrain = (tmp_path / "a" / "pretrain" / "train.txt").read_text()
    assert "Summary:" not in pretrain  # the base never sees the task itself
    other = tmp_path / "c"
    make_data.main(["--out", str(other), "--train", "40", "--validation", "10", "--seed", "4"])
    assert (other / "train.jsonl").read_bytes() != (tmp_path / "a" / "train.jsonl").read_bytes()
