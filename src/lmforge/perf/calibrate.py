"""``lmforge plan --calibrate``: run a few steps of the top candidates on this machine (the
real trainer, under torchrun), fit the time model's constants to the measured step times,
and save them for later plans (``--calibration FILE``). docs/plan.md describes the fit.

The fit has two scales, solved by least squares over the candidates:
``measured ~= a x (compute + recomputation + bubble) + b x (exposed communication)``;
the compute-like terms go as 1/efficiency, so the fitted efficiency is ``efficiency / a``,
and communication as 1/bandwidth, so both links' bandwidths become ``gb_per_s / b``
(latencies kept). A negative scale (too few or too alike candidates) is dropped and the
other refitted alone."""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Optional

from lmforge.perf.timing import Device, Link, StepTime


@dataclasses.dataclass
class Measured:
    step_s: Optional[float]  # median over the steps after the first; None: the run failed
    peak_mem_gib: Optional[float]  # as the trainer logs it (CPU: peak RSS of rank 0)
    error: str = ""


def train_command(config: Optional[str], overrides: list[str], keys: dict, out: Path,
                  nproc: int, steps: int) -> list[str]:
    """``lmforge train`` of one candidate under torchrun, ``steps`` steps, no checkpoint."""
    layout = [f"{k}={'null' if v is None else v}" for k, v in keys.items()]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", "-m", "lmforge.cli", "train",
            *([config] if config else []), *overrides, *layout, f"train.max_steps={steps}",
            "train.log_every=1", "train.save=false", f"train.output_dir={out}"]


def step_seconds(records: list[dict]) -> Optional[float]:
    """Median step time over the steps after the first (which builds the optimizer state
    and warms up): each step's tokens over its logged tokens/s."""
    times, before = [], 0
    for r in records:
        tokens = r.get("tokens", 0) - before
        before = r.get("tokens", before)
        if r["step"] > 1 and r.get("tokens_per_s"):
            times.append(tokens / r["tokens_per_s"])
    return statistics.median(times) if times else None


def measure(config: Optional[str], overrides: list[str], keys: dict, out: Path, nproc: int,
            steps: int = 4, timeout: int = 600) -> Measured:
    """Run one candidate and read its metrics.jsonl."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run(train_command(config, overrides, keys, out, nproc, steps),
                          capture_output=True, text=True, env=env, timeout=timeout)
    path = out / "metrics.jsonl"
    if proc.returncode != 0 or not path.exists():
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return Measured(None, None, f"exit {proc.returncode}: {tail}")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    peaks = [r["peak_mem_gib"] for r in records if r.get("peak_mem_gib") is not None]
    return Measured(step_seconds(records), max(peaks) if peaks else None)


def split_terms(t: StepTime) -> tuple[float, float]:
    """(compute-like seconds, communication seconds) of one prediction."""
    return t.compute + t.recompute + t.bubble, t.tp_comm + t.dp_comm + t.pp_comm


def fit_scales(terms: list[tuple[float, float]], measured: list[float]) -> tuple[float, float]:
    """Least-squares (a, b) >= 0 of ``measured ~= a x + b y`` (2 x 2 normal equations)."""
    sxx = sum(x * x for x, _ in terms)
    syy = sum(y * y for _, y in terms)
    sxy = sum(x * y for x, y in terms)
    sxt = sum(x * t for (x, _), t in zip(terms, measured))
    syt = sum(y * t for (_, y), t in zip(terms, measured))
    det = sxx * syy - sxy * sxy
    if det > 1e-12 * max(sxx * syy, 1e-300):
        a, b = (sxt * syy - syt * sxy) / det, (syt * sxx - sxt * sxy) / det
        if a > 0 and b > 0:
            return a, b
    if sxx <= 0:
        raise ValueError("--calibrate: no compute in the candidates' predictions")
    a = sxt / sxx  # communication unresolved: keep the links as they were
    return a, 1.0


def fitted_device(device: Device, a: float, b: float) -> Device:
    """``device`` with efficiency / a and both bandwidths / b."""
    return dataclasses.replace(
        device, efficiency=device.efficiency / a, calibrated=True,
        intra=Link(device.intra.gb_per_s / b, device.intra.latency_us),
        inter=Link(device.inter.gb_per_s / b, device.inter.latency_us))


def save_calibration(path: Path, name: str, device: Device, rows: list[dict]) -> None:
    """The fitted device constants and what they were fitted on, as JSON."""
    out = {"device": name, "part": device.part, "memory_gib": device.memory_gib,
           "peak_tflops": device.peak_flops / 1e12, "efficiency": device.efficiency,
           "intra": dataclasses.asdict(device.intra),
           "inter": dataclasses.asdict(device.inter), "measured": rows}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")


def load_calibration(path: Path) -> tuple[str, Device]:
    """(device name, fitted Device) saved by ``save_calibration``."""
    try:
        d = json.loads(Path(path).read_text())
        device = Device(d["part"], float(d["memory_gib"]), Link(**d["intra"]),
                        Link(**d["inter"]), float(d["efficiency"]),
                        peak_tflops=float(d["peak_tflops"]))
    except (OSError, KeyError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"--calibration: cannot read {path}: {e}") from e
    return d["device"], device


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(v):
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else 0.0
