"""``lmforge report RUN_DIR [RUN_DIR ...]``: plots and a Markdown summary of training runs.

Reads each run directory's ``metrics.jsonl`` (and ``config.yaml`` when present) and writes,
for one run or several overlaid on the same axes:

    loss_vs_step.png  loss_vs_tokens.png  tokens_per_s.png  memory.png  [mfu.png]
    summary.md        one row per run: steps, tokens, losses, throughput, MFU, memory

Plots use matplotlib's object API (no pyplot, no global backend change); matplotlib is
needed only here, and its absence is a one-line message (the summary is still written).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import yaml

from lmforge.perf.records import METRICS_FILE, iter_numbers, read_metrics


@dataclass
class Run:
    label: str
    path: Path
    records: list[dict]
    config: dict = field(default_factory=dict)


# name -> (x key, [(y key, line style)], y label)
PLOTS = {
    "loss_vs_step": ("step", [("loss", "-"), ("eval_loss", "o--")], "loss (nats/token)"),
    "loss_vs_tokens": ("tokens", [("loss", "-"), ("eval_loss", "o--")], "loss (nats/token)"),
    "tokens_per_s": ("step", [("tokens_per_s", "-")], "tokens/s (all devices)"),
    "memory": ("step", [("peak_mem_gib", "-"), ("peak_reserved_gib", ":")],
               "peak memory per device (GiB)"),
    "mfu": ("step", [("mfu", "-")], "MFU"),
}
X_LABELS = {"step": "optimizer step", "tokens": "tokens seen"}


def load_runs(run_dirs: list[str | Path]) -> list[Run]:
    """Runs with unique labels (the directory name, with its parent when names clash)."""
    if not run_dirs:
        raise ValueError("lmforge report: name at least one run directory")
    paths = [Path(d) for d in run_dirs]
    for p in paths:
        if not p.is_dir():
            raise FileNotFoundError(f"{p}: not a directory")
    names = [p.resolve().name for p in paths]
    runs = []
    for p, name in zip(paths, names):
        label = name if names.count(name) == 1 else f"{p.resolve().parent.name}/{name}"
        records = read_metrics(p)
        if not records:
            raise ValueError(f"{p / METRICS_FILE}: no records")
        runs.append(Run(label, p, records, _read_config(p)))
    return runs


def _read_config(run_dir: Path) -> dict:
    path = run_dir / "config.yaml"
    if not path.is_file():
        return {}
    try:
        return yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError:
        return {}


def _series(run: Run, x_key: str, y_key: str) -> tuple[list[float], list[float]]:
    if x_key == "step":
        pairs = iter_numbers(run.records, y_key)
        return [p[0] for p in pairs], [p[1] for p in pairs]
    xs, ys = [], []
    for r in run.records:
        x, y = r.get(x_key), r.get(y_key)
        if isinstance(x, (int, float)) and isinstance(y, (int, float)) and y == y:
            xs.append(float(x))
            ys.append(float(y))
    return xs, ys


def build_figures(runs: list[Run]) -> dict:
    """name -> matplotlib Figure with one axes on which every run is drawn (one colour per
    run). Plots no run has data for are left out."""
    from matplotlib.figure import Figure

    figures = {}
    colours = [f"C{i % 10}" for i in range(len(runs))]
    for name, (x_key, series, y_label) in PLOTS.items():
        fig = Figure(figsize=(7, 4.2), dpi=100)
        ax = fig.add_subplot(1, 1, 1)
        drawn = 0
        for run, colour in zip(runs, colours):
            for y_key, style in series:
                xs, ys = _series(run, x_key, y_key)
                if not xs:
                    continue
                label = run.label if y_key == series[0][0] else f"{run.label} ({y_key})"
                ax.plot(xs, ys, style, color=colour, label=label, markersize=3)
                drawn += 1
        if not drawn:
            continue
        ax.set_xlabel(X_LABELS.get(x_key, x_key))
        ax.set_ylabel(y_label)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_title(f"{y_label} vs {X_LABELS.get(x_key, x_key)}", fontsize=10)
        fig.tight_layout()
        figures[name] = fig
    return figures


def save_figures(figures: dict, out_dir: Path) -> dict[str, Path]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    written = {}
    for name, fig in figures.items():
        FigureCanvasAgg(fig)
        path = out_dir / f"{name}.png"
        fig.savefig(path)
        written[name] = path
    return written


# ---------------------------------------------------------------------------- summary

def _median(values: list[float]) -> Optional[float]:
    return statistics.median(values) if values else None


def summarize(run: Run) -> dict:
    """One run's headline numbers. Throughput medians leave out the first logged step
    (start-up: compilation, allocator warm-up) when there are later ones."""
    recs = run.records
    steady = recs[1:] if len(recs) > 1 else recs
    losses = iter_numbers(recs, "loss")
    evals = iter_numbers(recs, "eval_loss")
    mem = [v for _, v in iter_numbers(recs, "peak_mem_gib")]
    reserved = [v for _, v in iter_numbers(recs, "peak_reserved_gib")]
    cfg = run.config
    model, data = cfg.get("model") or {}, cfg.get("data") or {}
    setup = ""
    if data:
        setup = (f"{model.get('preset') or model.get('init_from') or '?'}, "
                 f"seq {data.get('seq_len')} x {data.get('micro_batch_size')}")
    return {
        "run": run.label,
        "setup": setup,
        "steps": recs[-1].get("step"),
        "tokens": recs[-1].get("tokens"),
        "first_loss": losses[0][1] if losses else None,
        "last_loss": losses[-1][1] if losses else None,
        "best_eval_loss": min(v for _, v in evals) if evals else None,
        "tokens_per_s": _median([v for _, v in iter_numbers(steady, "tokens_per_s")]),
        "tflops_per_device": _median([v for _, v in iter_numbers(steady, "tflops_per_device")]),
        "mfu": _median([v for _, v in iter_numbers(steady, "mfu")]),
        "peak_mem_gib": max(mem) if mem else None,
        "peak_reserved_gib": max(reserved) if reserved else None,
    }


COLUMNS = [("run", "run", "{}"), ("setup", "setup", "{}"), ("steps", "steps", "{}"),
           ("tokens", "tokens", "{:,}"), ("first_loss", "first loss", "{:.4f}"),
           ("last_loss", "last loss", "{:.4f}"), ("best_eval_loss", "best eval loss", "{:.4f}"),
           ("tokens_per_s", "tokens/s (median)", "{:,.0f}"),
           ("tflops_per_device", "TFLOP/s/device", "{:.3g}"), ("mfu", "MFU", "{:.1%}"),
           ("peak_mem_gib", "peak mem GiB", "{:.2f}"),
           ("peak_reserved_gib", "peak reserved GiB", "{:.2f}")]


def markdown_summary(rows: list[dict], plots: dict[str, Path]) -> str:
    lines = ["# Training report", "",
             "| " + " | ".join(title for _, title, _ in COLUMNS) + " |",
             "|" + "|".join("---" for _ in COLUMNS) + "|"]
    for row in rows:
        cells = []
        for key, _, fmt in COLUMNS:
            value = row.get(key)
            cells.append("-" if value in (None, "") else fmt.format(value))
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Throughput medians leave out the first logged step. MFU is empty where "
              "the device's peak is unknown (CPU, or an accelerator not in the peak table)."]
    if plots:
        lines.append("")
        for name, path in plots.items():
            lines.append(f"![{name}]({path.name})")
    return "\n".join(lines) + "\n"


def write_report(run_dirs: list[str | Path], out_dir: Optional[str | Path] = None) -> dict:
    """Plots + summary.md for the runs; returns {"summary": path, "plots": {name: path},
    "missing": reason or None}."""
    runs = load_runs(run_dirs)
    if out_dir is None:
        out_dir = runs[0].path / "report" if len(runs) == 1 else Path("lmforge-report")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    missing = None
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        missing = "plots skipped: matplotlib is not installed (pip install matplotlib)"
    plots = {} if missing else save_figures(build_figures(runs), out)
    summary = out / "summary.md"
    summary.write_text(markdown_summary([summarize(r) for r in runs], plots))
    return {"summary": summary, "plots": plots, "missing": missing}
