"""lm-evaluation-harness through lmforge (``lmforge bench-eval``): on a local multiple-
choice task, lmforge's model answering the harness gives the same per-choice
log-likelihoods (1e-4) and accuracy as the harness's own Hugging Face backend on the same
model directory; offline, a task whose data is not local is refused with how to fix it."""
from __future__ import annotations

import json

import pytest

from helpers.harness_tasks import task_yaml, write_mc_task
from helpers.hf_models import hf_model_dir
from lmforge.cli import main
from lmforge.data.tokenizer import load_tokenizer

pytest.importorskip("lm_eval")
pytestmark = pytest.mark.slow



@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("harness")
    model = hf_model_dir(root / "model", tokenizer="llama3", seed=6)
    rows = [{"question": f"what is {w} and the sky", "choices": [" blue", " green", " red"],
             "answer": i % 3} for i, w in enumerate("tell me about tokens models data".split())]
    return model, write_mc_task(root / "tasks", "tiny_mc", rows)


def _samples(results) -> list[list[float]]:
    return [[float(r[0]) for r in s["filtered_resps"]] for s in results["samples"]["tiny_mc"]]


def test_lmforge_answers_the_harness_as_its_hf_backend_does(assets):
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from lmforge.eval.harness import harness_model, offline
    from lmforge.models.hf import load_hf_model

    offline()
    model_dir, tasks = assets
    manager = TaskManager(include_path=str(tasks))
    ours = simple_evaluate(model=harness_model(load_hf_model(model_dir),
                                               load_tokenizer(model_dir), "cpu", 3),
                           tasks=["tiny_mc"], task_manager=manager, bootstrap_iters=0)
    hf = HFLM(pretrained=str(model_dir), dtype="float32", device="cpu", batch_size=4)
    theirs = simple_evaluate(model=hf, tasks=["tiny_mc"], task_manager=manager,
                             bootstrap_iters=0)
    for a, b in zip(_samples(ours), _samples(theirs), strict=True):
        assert a == pytest.approx(b, abs=1e-4)
    assert ours["results"]["tiny_mc"]["acc,none"] == theirs["results"]["tiny_mc"]["acc,none"]


def test_bench_eval_prints_the_scores_and_refuses_a_task_without_local_data(
        assets, tmp_path, capsys):
    model_dir, tasks = assets
    assert main(["bench-eval", "--model", str(model_dir), "--tasks", "tiny_mc",
                 "--include-path", str(tasks), "--limit", "4", "--device", "cpu",
                 "--output", str(tmp_path / "r.json")]) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["n_samples"]["tiny_mc"]["effective"] == 4
    assert 0 <= result["results"]["tiny_mc"]["acc,none"] <= 1
    hub = tmp_path / "hub"
    hub.mkdir()
    (hub / "hub.yaml").write_text(task_yaml("hub_mc", "x").replace(
        "dataset_path: json", "dataset_path: someone/not-on-this-machine"))
    assert main(["bench-eval", "--model", str(model_dir), "--tasks", "hub_mc",
                 "--include-path", str(hub), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "not on this machine" in err and "dataset_path: json" in err


def test_a_train_config_runs_its_harness_tasks_after_the_last_step_and_report_shows_them(
        assets, tmp_path, capsys):
    """``eval.harness_tasks``: the scores are logged at the last step (metrics.jsonl),
    written with lm-eval's results to RUN/harness/train-end.json, and equal bench-eval's
    on the exported hf/ (which writes RUN/harness/tiny_mc.json by default); lmforge
    report lists both."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lmforge.config import load_config
    from lmforge.perf.report import write_report
    from lmforge.train.loop import train

    model_dir, tasks = assets
    (tmp_path / "corpus.txt").write_text("the sky is blue and the grass is green\n" * 40)
    out = tmp_path / "run"
    cfg = load_config(None, [
        f"model.init_from={model_dir}", "data.kind=text", f"data.path={tmp_path / 'corpus.txt'}",
        "data.seq_len=16", "data.micro_batch_size=2", "data.eval_fraction=0",
        "train.max_steps=2", "train.sample_tokens=1", f"train.output_dir={out}",
        "train.progress_bar=false", "train.device=cpu", "eval.harness_tasks=tiny_mc",
        f"eval.harness_include_path={tasks}", "eval.harness_batch_size=3"])
    summary = train(cfg)
    assert "tiny_mc/acc" in capsys.readouterr().out  # the summary block
    end = json.loads((out / "harness" / "train-end.json").read_text())
    acc = end["results"]["tiny_mc"]["acc,none"]
    assert end["scores"] == {"harness/tiny_mc/acc": acc} == summary["harness"]
    last = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["step"] == 2 and last["harness/tiny_mc/acc"] == acc
    board = EventAccumulator(str(out / "tensorboard"))
    board.Reload()
    assert [(e.step, e.value) for e in board.Scalars("harness/tiny_mc/acc")] == [
        (2, pytest.approx(acc))]
    assert main(["bench-eval", "--model", str(out / "hf"), "--tasks", "tiny_mc",
                 "--include-path", str(tasks), "--device", "cpu"]) == 0
    after = json.loads((out / "harness" / "tiny_mc.json").read_text())
    assert after["scores"]["harness/tiny_mc/acc"] == acc  # the same model, exported
    report = write_report([out])["summary"].read_text()
    assert "## Benchmarks (lm-eval)" in report
    assert f"| run | train-end.json | tiny_mc/acc | {acc:.4f} |" in report
    assert f"| run | tiny_mc.json | tiny_mc/acc | {acc:.4f} |" in report


def test_an_unknown_harness_task_is_refused_before_training(assets, tmp_path, capsys):
    model_dir, tasks = assets
    assert main(["train", f"model.init_from={model_dir}", "data.kind=text",
                 f"data.path={tmp_path / 'none.txt'}", "data.seq_len=16",
                 f"train.output_dir={tmp_path / 'r'}",
                 "eval.harness_tasks=tiny_mc,no_such_task",
                 f"eval.harness_include_path={tasks}"]) == 2
    err = capsys.readouterr().err
    assert "eval.harness_tasks: no_such_task: no such task" in err
    assert not (tmp_path / "r").exists()
