"""`lmforge report` for comparing runs: learning-rate, grad-norm and eval-loss plots, the
memory axis from zero, and a column for each config value that differs between the runs."""
import json
import sys

import pytest

from lmforge.cli import build_parser
from lmforge.perf import report as R


def fake_run(path, lr=1e-3, steps=6, eval_every=3, config=None, final_eval=None):
    """A run directory: metrics.jsonl (lr warming up, grad norm falling, eval every
    ``eval_every`` steps), config.yaml and, with ``final_eval``, summary.json."""
    path.mkdir(parents=True)
    with open(path / "metrics.jsonl", "w") as f:
        for step in range(1, steps + 1):
            record = {"step": step, "loss": 5.0 - 0.1 * step, "lr": lr * step / steps,
                      "grad_norm": 4.0 / step, "tokens_per_s": 1000.0,
                      "peak_mem_gib": 10.0 + 0.01 * step, "tokens": 256 * step}
            if step % eval_every == 0:
                record["eval_loss"] = 5.5 - 0.1 * step
            f.write(json.dumps(record) + "\n")
    if config is not None:
        (path / "config.yaml").write_text(config)
    if final_eval is not None:
        (path / "summary.json").write_text(json.dumps({"steps": steps, "eval_loss": final_eval}))
    return path


CONFIG = """model:
  preset: tiny
data:
  path: {path}
  seq_len: 256
optim:
  lr: {lr}
train:
  output_dir: {out}
"""


def config(lr=0.001, path="[a.jsonl]", out="runs/x", extra=""):
    return CONFIG.format(lr=lr, path=path, out=out) + extra


def line_data(fig):
    ax = fig.axes[0]
    return {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata()))
            for ln in ax.get_lines()}


def test_lr_grad_norm_and_eval_loss_are_plotted_per_run(tmp_path):
    pytest.importorskip("matplotlib")
    a = fake_run(tmp_path / "a", lr=1e-3, eval_every=4, final_eval=4.2)  # 4.2: after step 6
    b = fake_run(tmp_path / "b", lr=3e-4, steps=4, eval_every=2)
    figures = R.build_figures(R.load_runs([a, b]))
    for name, y_label in (("lr", "learning rate"),
                          ("grad_norm", "gradient norm (before clipping)"),
                          ("eval_loss", "held-out loss (nats/token)")):
        ax = figures[name].axes[0]
        assert (ax.get_xlabel(), ax.get_ylabel()) == ("optimizer step", y_label)
    lr = line_data(figures["lr"])
    assert lr["a"] == ([1, 2, 3, 4, 5, 6], pytest.approx([1e-3 * s / 6 for s in range(1, 7)]))
    assert lr["b"][1][-1] == pytest.approx(3e-4)
    assert line_data(figures["grad_norm"])["b"] == ([1, 2, 3, 4], [4.0, 2.0, 4 / 3, 1.0])
    evals = line_data(figures["eval_loss"])
    assert evals["a"] == ([4, 6], pytest.approx([5.1, 4.2]))  # summary.json's ends it
    assert evals["b"] == ([2, 4], pytest.approx([5.3, 5.1]))
    # test_report.py checks that write_report saves these as PNGs with the others


def test_the_final_held_out_loss_counts_once_as_an_eval(tmp_path):
    # eval_every=4 of 6 steps: the eval after the last step exists only in summary.json
    run = R.load_runs([fake_run(tmp_path / "r", eval_every=4, final_eval=4.1)])[0]
    assert R.summarize(run)["best_eval_loss"] == pytest.approx(4.1)
    assert [p["step"] for p in run.points("eval_loss") if "eval_loss" in p] == [4, 6]
    # an eval already logged at the last step is not counted twice
    same = R.load_runs([fake_run(tmp_path / "s", eval_every=3, final_eval=4.9)])[0]
    assert [p["step"] for p in same.points("eval_loss") if "eval_loss" in p] == [3, 6]


def test_memory_axis_starts_at_zero(tmp_path):
    pytest.importorskip("matplotlib")
    figures = R.build_figures(R.load_runs([fake_run(tmp_path / "m")]))
    bottom, top = figures["memory"].axes[0].get_ylim()
    assert bottom == 0 and top >= 10.06  # 10 GiB used reads as 10 GiB, not as a flat band
    assert figures["lr"].axes[0].get_ylim()[0] == 0  # a 3x lower lr does not look 10x
    assert figures["tokens_per_s"].axes[0].get_ylim()[0] != 0  # others keep autoscaling


def config_table(summary_text):
    """The header and rows of the "Config values that differ" table."""
    lines = summary_text.split("## Config values that differ\n\n", 1)[1].splitlines()
    table = [ln for ln in lines if ln.startswith("|") and not ln.startswith("|---")]
    split = [[cell.strip() for cell in ln.strip("|").split(" | ")] for ln in table]
    return split[0], split[1:]


def test_summary_has_a_column_per_config_value_that_differs(tmp_path):
    a = fake_run(tmp_path / "a", config=config(lr=0.001, out="runs/a"))
    b = fake_run(tmp_path / "b", config=config(lr=0.0003, out="runs/b"))
    c = fake_run(tmp_path / "c", config=config(lr=0.001, path="['x|y.jsonl', b.jsonl]",
                                               out="runs/c", extra="  compile: true\n"))
    d = fake_run(tmp_path / "d")  # no config.yaml: a row of "-", no effect on the columns
    header, rows = config_table(R.markdown_summary(R.load_runs([a, b, c, d]), {}))
    # config order; train.output_dir always differs and the run column already names it
    assert header == ["run", "data.path", "optim.lr", "train.compile"]
    assert rows == [["a", '["a.jsonl"]', "0.001", "-"],
                    ["b", '["a.jsonl"]', "0.0003", "-"],
                    ["c", '["x\\|y.jsonl", "b.jsonl"]', "0.001", "true"],
                    ["d", "-", "-", "-"]]


def test_no_config_column_for_one_run_and_a_line_for_equal_configs(tmp_path):
    a = fake_run(tmp_path / "a", config=config(out="runs/a"))
    b = fake_run(tmp_path / "b", config=config(out="runs/b"))
    assert R.config_section(R.load_runs([a])) == []
    assert R.config_differences(R.load_runs([a, b])) == []
    assert "Every run has the same config.yaml" in R.markdown_summary(R.load_runs([a, b]), {})


def test_without_matplotlib_the_message_names_the_extra(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    run = fake_run(tmp_path / "r")
    ns = build_parser().parse_args(["report", str(run), "--output", str(tmp_path / "out")])
    assert ns.func(ns) == 1
    assert "pip install -e '.[report]'" in capsys.readouterr().err
    assert (tmp_path / "out" / "summary.md").is_file()
    assert not list((tmp_path / "out").glob("*.png"))
