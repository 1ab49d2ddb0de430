"""``lmforge plan --calibrate``: run a few steps of the top candidates on this machine (the
real trainer, under torchrun), fit the time model's constants to the measured step times,
and save them for later plans (``--calibration FILE``). docs/plan.md describes the fit.

A prediction is linear in four constants, so they are fitted by least squares over the
candidates: ``measured ~= a X + b Y + d L + c P``, where X is the compute-like time
(compute, recomputation, bubble) at the device's efficiency, Y the exposed communication
at its bandwidths without latency, L the same with its latencies and no bandwidth limit,
and P the block passes (Device.block_pass_us), in microseconds. The fitted device has
efficiency / a, bandwidths / b, latencies x d and c us per block pass. Scales are kept
positive: a constant whose best value would be negative or that the candidates cannot
tell apart is kept at its prior (a = b = d = 1, c = the device's) and the others are
refitted without it.
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Optional

from lmforge.perf.timing import Device, Link, block_passes, step_time


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


def fit_columns(setup, device: Device, gpus_per_node: int
                ) -> tuple[float, float, float, float]:
    """(X, Y, L, P) of one candidate: see the module's docstring."""
    no_latency = dataclasses.replace(
        device, intra=Link(device.intra.gb_per_s, 0.0), inter=Link(device.inter.gb_per_s, 0.0))
    unlimited = dataclasses.replace(
        device, intra=Link(1e15, device.intra.latency_us),
        inter=Link(1e15, device.inter.latency_us))
    t = step_time(setup, no_latency, gpus_per_node)
    latency = step_time(setup, unlimited, gpus_per_node)
    return (t.compute + t.recompute + t.bubble, t.tp_comm + t.cp_comm + t.dp_comm + t.pp_comm,
            latency.tp_comm + latency.cp_comm + latency.dp_comm + latency.pp_comm,
            block_passes(setup) * 1e-6)


def fit_constants(columns: list[tuple[float, ...]], measured: list[float],
                  prior: tuple[float, ...]) -> tuple[float, ...]:
    """Least squares of ``measured ~= sum_j k_j columns_j`` with every k_j > 0: over the
    subsets of constants that contain the first (compute), the others kept at ``prior``,
    the best fit whose constants are all positive."""
    n = len(prior)
    best, best_residual = None, float("inf")
    for free in _subsets_with_first(n):
        fixed = [j for j in range(n) if j not in free]
        target = [t - sum(prior[j] * row[j] for j in fixed) for row, t in zip(columns, measured)]
        solution = _least_squares([[row[j] for j in free] for row in columns], target)
        if solution is None or min(solution) <= 0:
            continue
        k = list(prior)
        for j, value in zip(free, solution):
            k[j] = value
        residual = sum((sum(kj * cj for kj, cj in zip(k, row)) - t) ** 2
                       for row, t in zip(columns, measured))
        if residual < best_residual - 1e-15:
            best, best_residual = tuple(k), residual
    if best is None:
        raise ValueError("--calibrate: the measured step times fit no positive compute rate")
    return best


def _subsets_with_first(n: int) -> list[list[int]]:
    return [[0] + [j for j in range(1, n) if mask >> (j - 1) & 1] for mask in range(2 ** (n - 1))]


def _least_squares(rows: list[list[float]], target: list[float]) -> Optional[list[float]]:
    """The least-squares solution, or None where the columns cannot be told apart."""
    import numpy as np

    a, y = np.asarray(rows, dtype=float), np.asarray(target, dtype=float)
    if a.shape[0] < a.shape[1] or np.linalg.matrix_rank(a) < a.shape[1]:
        return None
    return [float(v) for v in np.linalg.lstsq(a, y, rcond=None)[0]]


def prior_constants(device: Device) -> tuple[float, float, float, float]:
    return 1.0, 1.0, 1.0, device.block_pass_us


def fitted_device(device: Device, constants: tuple[float, ...]) -> Device:
    """``device`` with efficiency / a, bandwidths / b, latencies x d, c us per block pass."""
    a, b, d, c = constants
    return dataclasses.replace(
        device, efficiency=device.efficiency / a, calibrated=True, block_pass_us=c,
        intra=Link(device.intra.gb_per_s / b, device.intra.latency_us * d),
        inter=Link(device.inter.gb_per_s / b, device.inter.latency_us * d))


def save_calibration(path: Path, name: str, device: Device, rows: list[dict]) -> None:
    """The fitted device constants and what they were fitted on, as JSON."""
    out = {"device": name, "part": device.part, "memory_gib": device.memory_gib,
           "peak_tflops": device.peak_flops / 1e12, "efficiency": device.efficiency,
           "block_pass_us": device.block_pass_us,
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
                        peak_tflops=float(d["peak_tflops"]),
                        block_pass_us=float(d.get("block_pass_us", 0.0)))
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
