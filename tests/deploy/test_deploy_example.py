"""examples/deploy/run.sh end to end on the CPU (shortened): a tiny base model pretrained
on random-colour statements, scored on a local multiple-choice task, fine-tuned on the
true colours with the task scored after the last step, exported to GGUF and continued in
llama.cpp. The accuracy rises from about chance (1 in 8) to above it, the end-of-training
score equals bench-eval's on the exported hf/, llama.cpp's greedy text equals lmforge's,
and the report shows both runs' scores."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.runs import run_example

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed "
                    "(make test-deploy installs it)")
pytest.importorskip("lm_eval")
pytestmark = [pytest.mark.deploy, pytest.mark.slow]  # (minutes: make test-deploy runs it)


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    return run_example("deploy/run.sh", tmp_path_factory.mktemp("deploy-example"), 1200,
                       BASE_STEPS=150, SFT_STEPS=100)


def _acc(path: Path) -> float:
    return json.loads(path.read_text())["scores"]["harness/colours/acc"]


def test_fine_tuning_raises_the_task_accuracy_and_the_report_shows_before_and_after(example):
    before = _acc(example / "base" / "harness" / "colours.json")
    after = _acc(example / "sft" / "harness" / "train-end.json")
    assert before <= 0.4  # the base: colours at random (chance is 1 in 8)
    assert after >= before + 0.3
    report = (example / "report" / "summary.md").read_text()
    assert f"| base | colours.json | colours/acc | {before:.4f} |" in report
    assert f"| sft | train-end.json | colours/acc | {after:.4f} |" in report


def test_llama_cpp_continues_the_prompt_as_lmforge_does(example):
    llama_cpp_text = (example / "llama-cpp.txt").read_text()
    assert llama_cpp_text == (example / "lmforge.txt").read_text()
    assert llama_cpp_text.startswith("What colour is the sky?\nThe sky is ")
