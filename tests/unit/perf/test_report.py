"""`lmforge report`: PNG plots for one run and for several overlaid, and the summary."""
import json

import pytest

pytest.importorskip("matplotlib")

from lmforge.perf import report as R  # noqa: E402
from lmforge.cli import build_parser  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PLOTS = ("loss_vs_step", "loss_vs_tokens", "eval_loss", "lr", "grad_norm", "tokens_per_s",
         "memory")


def fake_run(path, steps=10, start_loss=6.0, mfu=None, eval_every=5):
    path.mkdir(parents=True)
    with open(path / "metrics.jsonl", "w") as f:
        for step in range(1, steps + 1):
            record = {"step": step, "loss": start_loss - 0.2 * step, "lr": 1e-3,
                      "grad_norm": 1.0, "tokens_per_s": 1000.0 + step,
                      "tflops_per_device": 0.5, "mfu": mfu, "peak_mem_gib": 1.0 + 0.01 * step,
                      "peak_reserved_gib": 1.5, "tokens": 512 * step}
            if step % eval_every == 0:
                record["eval_loss"] = start_loss - 0.15 * step
            f.write(json.dumps(record) + "\n")
    (path / "config.yaml").write_text("model:\n  preset: tiny\ndata:\n  seq_len: 256\n"
                                      "  micro_batch_size: 2\n")
    return path


def check_pngs(out_dir, names):
    for name in names:
        data = (out_dir / f"{name}.png").read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 2000, name


def test_report_of_one_run_writes_the_plots_and_a_summary_row(tmp_path):
    run = fake_run(tmp_path / "a")
    result = R.write_report([run])
    out = run / "report"
    check_pngs(out, PLOTS)
    assert not (out / "mfu.png").exists()  # no run has an MFU
    summary = (out / "summary.md").read_text()
    assert "| a | tiny, seq 256 x 2 | 10 | 5,120 | 5.8000 | 4.0000 | 4.5000 |" in summary
    assert "![loss_vs_step](loss_vs_step.png)" in summary
    assert result["missing"] is None


def test_two_runs_share_each_plot(tmp_path):
    a = fake_run(tmp_path / "exp1" / "run", mfu=0.4)
    b = fake_run(tmp_path / "exp2" / "run", start_loss=5.0, steps=6)
    runs = R.load_runs([a, b])
    assert [r.label for r in runs] == ["exp1/run", "exp2/run"]  # same names: parent added
    figures = R.build_figures(runs)
    for name in PLOTS:
        ax = figures[name].axes[0]
        assert len(figures[name].axes) == 1
        labels = {line.get_label().split(" (")[0] for line in ax.get_lines()}
        assert labels == {"exp1/run", "exp2/run"}, name  # both runs on the same axes
    assert {ln.get_label() for ln in figures["mfu"].axes[0].get_lines()} == {"exp1/run"}
    out = tmp_path / "compare"
    R.write_report([a, b], out)
    check_pngs(out, PLOTS + ("mfu",))
    rows = [ln for ln in (out / "summary.md").read_text().splitlines()
            if ln.startswith("| exp")]
    assert len(rows) == 2 and "40.0%" in rows[0]


def test_cli_prints_the_written_paths_and_names_a_missing_run(tmp_path, capsys):
    run = fake_run(tmp_path / "r")
    ns = build_parser().parse_args(["report", str(run), "--output", str(tmp_path / "out")])
    assert ns.func(ns) == 0
    printed = capsys.readouterr().out
    assert "summary.md" in printed and "loss_vs_tokens.png" in printed
    with pytest.raises(FileNotFoundError, match="not a directory"):
        R.write_report([tmp_path / "missing"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        R.write_report([tmp_path / "empty"])


def test_summary_skips_the_first_step_in_throughput(tmp_path):
    run = R.load_runs([fake_run(tmp_path / "s", steps=3)])[0]
    row = R.summarize(run)
    assert row["tokens_per_s"] == pytest.approx(1002.5)  # median of steps 2 and 3
    assert row["best_eval_loss"] is None and row["peak_mem_gib"] == pytest.approx(1.03)
