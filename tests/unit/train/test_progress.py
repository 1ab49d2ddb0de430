"""What a run shows: the progress bar's fields, log lines with step N/M, elapsed and ETA
when there is no terminal, one line per phase, the summary block and summary.json (whose
first loss is the run's across a resume); held-out evaluation on train.eval_every's own
schedule, the final one in metrics.jsonl and TensorBoard."""
import contextlib
import io
import json

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from helpers.tiny_models import tiny_model_overrides
from lmforge.config import load_config
from lmforge.perf.records import read_metrics
from lmforge.train.loop import train
from lmforge.train.progress import Progress, no_evaluation, summary_lines

RECORD = {"loss": 2.5, "lr": 3e-4, "grad_norm": 0.75, "tokens_per_s": 1234.0, "mfu": None,
          "peak_mem_gib": 1.5}


def _progress(monkeypatch, bar: bool, **kwargs) -> Progress:
    clock = iter(float(t) for t in range(0, 1000, 10))  # each reading 10 s later
    monkeypatch.setattr("lmforge.train.progress.time.perf_counter", lambda: next(clock))
    cfg = load_config(None, ["train.max_steps=10", f"train.progress_bar={str(bar).lower()}"])
    return Progress(cfg, enabled=True, **kwargs)


def test_without_a_terminal_a_logged_step_is_one_line_with_step_of_total_elapsed_eta(
        monkeypatch, capsys):
    progress = _progress(monkeypatch, bar=False, start_step=4)  # resumed after step 4
    progress.logged(6, {**RECORD, "eval_loss": 2.0, "eval_tokens": 4096})
    line = capsys.readouterr().out
    assert line.count("\n") == 1
    assert line.startswith("step 6/10  loss 2.5000  lr 3.00e-04  grad_norm 0.750  "
                           "tokens/s 1234")
    assert "eval_loss 2.0000 (perplexity 7.39, 4,096 held-out tokens)" in line
    # 2 steps took 10 s (the first reading started the clock): 4 more take 20 s
    assert line.rstrip().endswith("elapsed 0:00:10  ETA 0:00:20")


def test_the_bar_shows_loss_lr_grad_norm_tokens_per_s_and_the_last_eval_loss(
        monkeypatch, capsys):
    progress = _progress(monkeypatch, bar=True, start_step=2)
    assert (progress.bar.n, progress.bar.total) == (2, 10)
    progress.logged(3, {**RECORD, "eval_loss": 2.0, "eval_tokens": 64})
    progress.logged(4, RECORD)  # no evaluation at this step: the last one stays shown
    progress.advance(tokens=512)
    postfix = progress.bar.postfix
    for shown in ("loss=2.500", "lr=3.00e-04", "grad_norm=0.750", "tok/s=1234", "eval=2.000"):
        assert shown in postfix, postfix
    assert "step 3/10  eval_loss 2.0000" in capsys.readouterr().out  # kept above the bar
    progress.close()
    assert progress.tokens == 512 and progress.bar is None


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("progress-corpus")
    words = "the quick brown fox jumps over a lazy dog while cats sleep".split()
    for f in range(12):  # files, so the text corpus holds whole ones out
        (root / f"part{f}.txt").write_text("\n".join(
            " ".join(words[(i * f + j) % len(words)] for j in range(14)) for i in range(12)))
    return root


def _train(corpus, out, *overrides):
    cfg = load_config(None, [
        *tiny_model_overrides(vocab_size=259), "data.kind=text", f"data.path={corpus}",
        "data.eval_fraction=0.25", "data.seq_len=16", "data.micro_batch_size=2",
        "data.tokenizer_vocab_size=259", "train.eval_batches=2", "train.sample_tokens=2",
        "train.progress_bar=false", "train.device=cpu", f"train.output_dir={out}",
        *overrides])
    return train(cfg)


@pytest.fixture(scope="module")
def run(corpus, tmp_path_factory):
    """One run (module scope, so capsys is not at hand: stdout is redirected)."""
    out = tmp_path_factory.mktemp("progress-run") / "run"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        _train(corpus, out, "train.max_steps=7", "train.log_every=4", "train.eval_every=3")
    return out, stdout.getvalue()


def test_eval_every_runs_on_its_own_schedule_and_the_last_goes_to_metrics_and_tensorboard(
        run):
    out, _ = run
    records = read_metrics(out)
    # logged: the first step, every 4th, the last, and every evaluated one (3, 6, 7)
    assert [r["step"] for r in records] == [1, 3, 4, 6, 7]
    assert [r["step"] for r in records if "eval_loss" in r] == [3, 6, 7]
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    board = [(e.step, e.value) for e in acc.Scalars("loss/eval_loss")]
    assert [step for step, _ in board] == [3, 6, 7]
    assert board[-1][1] == pytest.approx(records[-1]["eval_loss"], rel=1e-6)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_loss"] == records[-1]["eval_loss"] and summary["eval_tokens"] > 0


def test_phases_say_what_they_do_and_the_run_ends_with_a_summary(run):
    out, stdout = run
    lines = stdout.splitlines()
    for phase in ("tokenizer: training a 259-token BPE tokenizer",
                  "data: reading and tokenizing", "model: building",
                  "evaluation: every 3 steps (train.eval_every) and at the end",
                  f"export: writing {out / 'hf'}"):
        assert any(line.startswith(phase) for line in lines), phase
    assert "step 4/7  loss" in stdout and "ETA" in stdout
    summary = json.loads((out / "summary.json").read_text())
    for key in ("wall_time_s", "tokens", "tokens_per_s", "peak_mem_gib", "first_loss",
                "last_loss", "eval_loss", "checkpoint", "hf_dir", "metrics"):
        assert summary[key] is not None, key
    assert summary["tokens"] == 7 * 2 * 16 and summary["step"] == summary["steps"] == 7
    block = lines[lines.index("summary"):]
    for name in ("steps", "wall time", "tokens", "peak memory", "train loss", "eval loss",
                 "checkpoint", "hf", "metrics"):
        assert any(line.split("  ")[1:2] == [name] for line in block), name
    assert summary["checkpoint"] in stdout and summary["hf_dir"] in stdout


def test_summary_of_a_resumed_run_has_the_runs_first_loss(corpus, tmp_path, capsys):
    out, steps = tmp_path / "run", ["train.max_steps=3", "train.log_every=1"]
    _train(corpus, out, *steps, "train.stop_at_step=1")
    stopped = capsys.readouterr().out
    assert "summary" in stopped.splitlines() and "stopped after step 1 of 3" in stopped
    assert not (out / "summary.json").exists()  # the run has not ended
    _train(corpus, out, *steps, "train.resume=auto")
    summary = json.loads((out / "summary.json").read_text())
    first = read_metrics(out)[0]
    assert first["step"] == 1 and summary["first_loss"] == first["loss"]
    assert summary["start_step"] == 1 and "(this invocation: 2-3)" in capsys.readouterr().out


def test_the_first_step_is_announced_as_it_starts_before_any_step_ends(run):
    _, stdout = run
    lines = stdout.splitlines()
    started = lines.index("step 1 of 7 started: 1 x 2 sequences of 16 tokens per rank; the "
                          "first step is the slowest (memory allocation, kernel warm-up)")
    assert started < next(i for i, line in enumerate(lines) if line.startswith("step 1/7  "))


def test_a_run_stopped_before_its_first_evaluation_says_why_it_has_no_eval_loss(
        corpus, tmp_path, capsys):
    _train(corpus, tmp_path / "run", "train.max_steps=6", "train.eval_every=4",
           "train.stop_at_step=2")
    assert ("eval loss    none (stopped at step 2; train.eval_every=4 evaluates first at "
            "step 4)") in capsys.readouterr().out


class _HeldOut:
    eval_batches = staticmethod(lambda: iter(()))
    eval_note = "2 files"


@pytest.mark.parametrize("keys, step, reason", [
    (["train.eval_every=0"], 2, "stopped at step 2; train.eval_every=0 evaluates only at "
                                "the last step, 10"),
    (["train.eval_every=20"], 3, "stopped at step 3; train.eval_every=20 evaluates first "
                                 "at step 10"),  # past max_steps: the last step's
])
def test_why_there_is_no_eval_loss_names_the_setting_and_the_step(keys, step, reason):
    cfg = load_config(None, ["train.max_steps=10", *keys])
    assert no_evaluation(cfg, _HeldOut(), step) == reason
    no_data = type("NoData", (), {"eval_batches": None,
                                  "eval_note": "data.eval_fraction=0 and no data.eval_path"})
    assert no_evaluation(cfg, no_data(), step) == ("no held-out data: data.eval_fraction=0 "
                                                   "and no data.eval_path")


def test_an_earlier_evaluation_is_the_summarys_eval_loss_with_its_step(tmp_path):
    """Stopped at step 6 of 8 (train.stop_at_step) after an evaluation at step 4."""
    history = [{"step": 4, "loss": 3.0, "tokens": 64, "eval_loss": 2.5, "eval_tokens": 64},
               {"step": 6, "loss": 2.0, "tokens": 96}]
    progress = Progress(load_config(None, ["train.max_steps=8"]), enabled=False)
    progress.close()
    summary = progress.summary(tmp_path, history, torch.device("cpu"), _HeldOut())
    assert (summary["eval_loss"], summary["eval_step"], summary["eval_note"]) == (2.5, 4, None)
    line = next(x for x in summary_lines(summary) if x.startswith("  eval loss"))
    assert line.endswith("(perplexity 12.18, 64 held-out tokens, at step 4)")


def test_a_grpo_runs_summary_reports_its_held_out_reward(tmp_path):
    """GRPO's evaluation logs eval_reward (no eval_loss): the summary says it, with the
    held-out prompts and the step, instead of "no evaluation recorded"."""
    history = [{"step": 2, "loss": 0.1, "tokens": 64, "eval_reward": 0.625,
                "eval_prompts": 8, "eval_rewards/exact_answer/mean": 0.5},
               {"step": 3, "loss": 0.2, "tokens": 96}]
    progress = Progress(load_config(None, ["train.max_steps=3"]), enabled=False)
    progress.close()
    summary = progress.summary(tmp_path, history, torch.device("cpu"), _HeldOut())
    assert (summary["eval_reward"], summary["eval_prompts"], summary["eval_step"],
            summary["eval_note"]) == (0.625, 8, 2, None)
    line = next(x for x in summary_lines(summary) if x.startswith("  eval reward"))
    assert line.endswith("0.6250 (8 held-out prompts, greedy, at step 2)")
    assert not any(x.startswith("  eval loss") for x in summary_lines(summary))
