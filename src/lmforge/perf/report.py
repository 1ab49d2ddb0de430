"""``lmforge report RUN_DIR [RUN_DIR ...]``: plots and a Markdown summary of training runs.

Reads each run directory's ``metrics.jsonl`` (and ``config.yaml`` and ``summary.json`` when
present) and writes, for one run or several overlaid on the same axes:

    loss_vs_step.png  loss_vs_tokens.png  eval_loss.png  lr.png  grad_norm.png
    tokens_per_s.png  memory.png  [mfu.png]      (a plot no run has data for is left out)
    summary.md        one row per run: steps, tokens, losses, throughput, MFU, memory;
                      the lm-eval scores in each run's harness/*.json; then one column
                      per config value that differs between the runs

Plots use matplotlib's object API (no pyplot, no global backend change); matplotlib is
needed only here (the ``report`` extra), and its absence is a one-line message (the summary
is still written).
"""
from __future__ import annotations

import importlib.util
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from lmforge import fsio
from lmforge.config import read_yaml_file
from lmforge.perf.records import (HARNESS_DIR, METRICS_FILE, is_finite_number, iter_numbers,
                                  read_metrics)

INSTALL_HINT = "pip install -e '.[report]' (or pip install matplotlib)"


@dataclass
class Run:
    label: str
    path: Path
    records: list[dict]
    config: dict = field(default_factory=dict)
    summary: dict = field(default_factory=dict)  # summary.json: the final held-out loss
    # harness/*.json (the end of training's and bench-eval's): file name -> their scores
    benchmarks: dict = field(default_factory=dict)

    def final_eval(self) -> Optional[dict]:
        """The held-out loss the run measured after its last step (summary.json), as a
        record, unless metrics.jsonl already holds an eval at that step."""
        loss, step = self.summary.get("eval_loss"), self.summary.get("steps")
        if not (is_finite_number(loss) and is_finite_number(step)):
            return None
        if any(r.get("step") == step and "eval_loss" in r for r in self.records):
            return None
        at_step = [r for r in self.records if r.get("step") == step and "tokens" in r]
        return {"step": step, "eval_loss": loss,
                **({"tokens": at_step[-1]["tokens"]} if at_step else {})}

    def points(self, key: str) -> list[dict]:
        """The records that may carry ``key``: the final held-out loss counts as an eval."""
        final = self.final_eval() if key == "eval_loss" else None
        return self.records + [final] if final else self.records


@dataclass(frozen=True)
class Plot:
    x: str  # "step" or "tokens"
    series: tuple[tuple[str, str], ...]  # (record key, line style); the first: the run alone
    y_label: str
    from_zero: bool = False  # the y axis starts at 0: the size matters, not only the change


PLOTS = {
    "loss_vs_step": Plot("step", (("loss", "-"), ("eval_loss", "o--")), "loss (nats/token)"),
    "loss_vs_tokens": Plot("tokens", (("loss", "-"), ("eval_loss", "o--")),
                           "loss (nats/token)"),
    "eval_loss": Plot("step", (("eval_loss", "o-"),), "held-out loss (nats/token)"),
    "lr": Plot("step", (("lr", "-"),), "learning rate", from_zero=True),
    "grad_norm": Plot("step", (("grad_norm", "-"),), "gradient norm (before clipping)"),
    "tokens_per_s": Plot("step", (("tokens_per_s", "-"),), "tokens/s (all devices)"),
    "memory": Plot("step", (("peak_mem_gib", "-"), ("peak_reserved_gib", ":")),
                   "peak memory per device (GiB)", from_zero=True),
    "mfu": Plot("step", (("mfu", "-"),), "MFU"),
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
        runs.append(Run(label, p, records, _read_mapping(p / "config.yaml", read_yaml_file),
                        _read_mapping(p / "summary.json", _read_json), read_benchmarks(p)))
    return runs


def read_benchmarks(run_dir: Path) -> dict[str, dict]:
    """The flat scores (``harness/<task>/<metric>``) of each lm-eval result in
    ``run_dir/harness/``; a file without them is left out."""
    found = {}
    for path in sorted((run_dir / HARNESS_DIR).glob("*.json")):
        scores = _read_mapping(path, _read_json).get("scores")
        if isinstance(scores, dict):
            found[path.name] = {k: v for k, v in scores.items() if is_finite_number(v)}
    return found


def benchmark_section(runs: list[Run]) -> list[str]:
    """One row per run, result file and score."""
    rows = [[run.label, name, metric.removeprefix("harness/"), f"{value:.4f}"]
            for run in runs for name, scores in run.benchmarks.items()
            for metric, value in scores.items()]
    if not rows:
        return []
    return (["", "## Benchmarks (lm-eval)", "",
             "From each run's `harness/`: `train-end.json` is `eval.harness_tasks` after the "
             "last step, the others `lmforge bench-eval` of the run's model.", ""]
            + _table(["run", "file", "task/metric", "value"], rows))


def _read_mapping(path: Path, parse) -> dict:
    """The file's top-level mapping; {} when it is absent or unreadable (a run killed while
    writing it still gets its plots)."""
    if not path.is_file():
        return {}
    try:
        data = parse(path)
    except ValueError:  # ConfigError (YAML) and JSONDecodeError are ValueErrors
        return {}
    return data if isinstance(data, dict) else {}


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def _series(run: Run, x_key: str, y_key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in run.points(y_key):
        x, y = r.get(x_key), r.get(y_key)
        if is_finite_number(x) and is_finite_number(y):
            xs.append(float(x))
            ys.append(float(y))
    return xs, ys


def _draw(ax, runs: list[Run], plot: Plot) -> int:
    """Every run's series on ``ax`` (one colour per run); returns the lines drawn."""
    drawn = 0
    for i, run in enumerate(runs):
        for y_key, style in plot.series:
            xs, ys = _series(run, plot.x, y_key)
            if not xs:
                continue
            label = run.label if y_key == plot.series[0][0] else f"{run.label} ({y_key})"
            ax.plot(xs, ys, style, color=f"C{i % 10}", label=label, markersize=3)
            drawn += 1
    return drawn


def build_figures(runs: list[Run]) -> dict:
    """name -> matplotlib Figure with one axes on which every run is drawn (one colour per
    run). Plots no run has data for are left out."""
    from matplotlib.figure import Figure

    figures = {}
    for name, plot in PLOTS.items():
        fig = Figure(figsize=(7, 4.2), dpi=100)
        ax = fig.add_subplot(1, 1, 1)
        if not _draw(ax, runs, plot):
            continue
        if plot.from_zero:  # with headroom: the autoscaled top is the highest point itself
            ax.set_ylim(0, ax.dataLim.y1 * 1.05 or 1)
        x_label = X_LABELS.get(plot.x, plot.x)
        ax.set_xlabel(x_label)
        ax.set_ylabel(plot.y_label)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_title(f"{plot.y_label} vs {x_label}", fontsize=10)
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
    evals = iter_numbers(run.points("eval_loss"), "eval_loss")
    tokens = [r["tokens"] for r in recs if is_finite_number(r.get("tokens"))]
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
        "steps": max((r.get("step") for r in recs if is_finite_number(r.get("step"))),
                     default=None),
        "tokens": tokens[-1] if tokens else None,
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


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return (["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
            + ["| " + " | ".join(row) + " |" for row in rows])


def markdown_summary(runs: list[Run], plots: dict[str, Path]) -> str:
    rows = []
    for row in map(summarize, runs):
        rows.append(["-" if row.get(key) in (None, "") else fmt.format(row[key])
                     for key, _, fmt in COLUMNS])
    lines = ["# Training report", ""] + _table([title for _, title, _ in COLUMNS], rows)
    lines += ["", "Throughput medians leave out the first logged step. MFU is empty where "
              "the device's peak is unknown (CPU, or an accelerator not in the peak table). "
              "The best eval loss includes the held-out loss after the last step "
              "(summary.json)."]
    lines += benchmark_section(runs)
    lines += config_section(runs)
    if plots:
        lines += ["", "## Plots", ""]
        for name, path in plots.items():
            lines.append(f"![{name}]({path.name})")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------- config differences

# The run column already names each run's directory, which is where its output_dir pointed.
NOT_COMPARED = frozenset({"train.output_dir"})
_ABSENT = object()  # a key one run's config.yaml lacks (another lmforge version, say)


def flatten(config: dict, prefix: str = "") -> dict[str, Any]:
    """{"optim": {"lr": 1e-3}} -> {"optim.lr": 1e-3}; lists and empty mappings are values."""
    flat = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def config_differences(runs: list[Run]) -> list[str]:
    """Dotted config keys whose values are not the same in every run that has a
    config.yaml, in the order the configs list them (first run first)."""
    flats = [flatten(r.config) for r in runs if r.config]
    if len(flats) < 2:
        return []
    keys = dict.fromkeys(key for flat in flats for key in flat)
    return [key for key in keys if key not in NOT_COMPARED
            and any(flat.get(key, _ABSENT) != flats[0].get(key, _ABSENT) for flat in flats)]


def config_cell(config: dict, key: str) -> str:
    """A flattened config value as YAML would spell it; "-" where the run has none."""
    value = flatten(config).get(key, _ABSENT)
    if value is _ABSENT:
        return "-"
    text = value if isinstance(value, str) else json.dumps(value)
    return text.replace("|", "\\|")  # a bare | would end the Markdown cell


def config_section(runs: list[Run]) -> list[str]:
    """A table with one column per config value that differs between the runs."""
    if sum(bool(r.config) for r in runs) < 2:
        return []
    keys = config_differences(runs)
    if not keys:
        return ["", "## Config", "", "Every run has the same config.yaml (besides "
                "train.output_dir)."]
    rows = [[r.label] + [config_cell(r.config, k) for k in keys] for r in runs]
    return ["", "## Config values that differ", ""] + _table(["run"] + keys, rows)


def plotting_missing() -> Optional[str]:
    """Why no plots can be drawn here, or None."""
    if importlib.util.find_spec("matplotlib") is None:
        return f"plots skipped: matplotlib is not installed ({INSTALL_HINT})"
    return None


def write_report(run_dirs: list[str | Path], out_dir: Optional[str | Path] = None) -> dict:
    """Plots + summary.md for the runs; returns {"summary": path, "plots": {name: path},
    "missing": reason or None}."""
    if out_dir is None and run_dirs:
        out_dir = Path(run_dirs[0]) / "report" if len(run_dirs) == 1 else "lmforge-report"
    if out_dir is not None:
        fsio.check_writable(out_dir, "--output", kind="dir")  # before any run is read
    runs = load_runs(run_dirs)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    missing = plotting_missing()
    plots = {} if missing else save_figures(build_figures(runs), out)
    summary = out / "summary.md"
    summary.write_text(markdown_summary(runs, plots))
    return {"summary": summary, "plots": plots, "missing": missing}
