"""The plan's predictions against this machine: 2 gloo processes on the CPU, the tiny
demo model, 8 layouts. Per layout: the estimate's peak allocated tensor bytes against the
peak of live tensor storage measured in forward-backward from step 2 on
(bench/tensor_peak_worker.py, max over ranks), and the step time predicted after
``--calibrate``'s fit (on all 8) against the measured median. Prints a Markdown table and
Spearman's rho; docs/plan.md quotes its output.

    python bench/plan_check.py --out /tmp/plan-check [--layouts 8]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from lmforge.cli.common import config_and_overrides  # noqa: E402
from lmforge.config import load_config  # noqa: E402
from lmforge.perf.calibrate import (fit_columns, fit_constants, fitted_device,  # noqa
                                    measure, prior_constants, spearman)
from lmforge.perf.estimate import estimate_memory  # noqa: E402
from lmforge.perf.layout_search import evaluate  # noqa: E402
from lmforge.perf.timing import DEVICES, step_time  # noqa: E402

# Untied, so that every layout (pipelines included) runs the same model.
BASE = ["data.seq_len=64", "data.global_batch_size=8", "data.eval_fraction=0",
        "model.tie_embeddings=false"]
LAYOUTS = [  # (name, keys)
    ("zero3 mb4", {"parallel.dp_shard": 2, "parallel.zero": 3, "data.micro_batch_size": 4}),
    ("zero2 mb4", {"parallel.dp_shard": 2, "parallel.zero": 2, "data.micro_batch_size": 4}),
    ("zero3 mb2 full", {"parallel.dp_shard": 2, "parallel.zero": 3,
                        "data.micro_batch_size": 2, "train.activation_checkpointing": "full"}),
    ("tp2 mb4", {"parallel.tp": 2, "parallel.dp_shard": 1, "data.micro_batch_size": 4}),
    ("tp2 mb8 full", {"parallel.tp": 2, "parallel.dp_shard": 1, "data.micro_batch_size": 8,
                      "train.activation_checkpointing": "full"}),
    ("pp2 gpipe mb2", {"parallel.pp": 2, "parallel.dp_shard": 1,
                       "parallel.pp_schedule": "gpipe", "data.micro_batch_size": 2}),
    ("pp2 1f1b mb2", {"parallel.pp": 2, "parallel.dp_shard": 1,
                      "parallel.pp_schedule": "1f1b", "data.micro_batch_size": 2}),
    ("pp2 1f1b mb4 full", {"parallel.pp": 2, "parallel.dp_shard": 1,
                           "parallel.pp_schedule": "1f1b", "data.micro_batch_size": 4,
                           "train.activation_checkpointing": "full"}),
]


def tensor_peak(keys: dict, out: Path) -> float:
    """Max over the 2 ranks of the measured forward-backward tensor peak, bytes."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LMFORGE_TENSOR_PEAK_DIR": str(out / "peak"),
           "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node=2", str(ROOT / "bench" / "tensor_peak_worker.py"), *BASE,
           *[f"{k}={v}" for k, v in keys.items()], "train.max_steps=2", "train.save=false",
           f"train.output_dir={out / 'mem'}"]
    subprocess.run(cmd, check=True, capture_output=True, env=env, timeout=600)
    return max(json.loads(p.read_text())["step_peak_bytes"]
               for p in (out / "peak").glob("rank*.json"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layouts", type=int, default=len(LAYOUTS))
    ap.add_argument("--steps", type=int, default=16, help="timed steps per layout, + 1")
    ns = ap.parse_args()
    os.environ["PYTHONPATH"] = str(ROOT / "src")
    cfg = load_config(*config_and_overrides(None, BASE))
    device, rows = DEVICES["cpu"], []
    for i, (name, keys) in enumerate(LAYOUTS[:ns.layouts]):
        cand = evaluate(cfg, keys, 2, 8, device)
        out = Path(ns.out) / f"l{i}"
        m = measure(None, BASE, keys, out / "time", 2, steps=ns.steps + 1)
        rows.append((name, cand, m, tensor_peak(keys, out)))
        print(f"ran {name}: {m.step_s} s, {m.error}", flush=True)
    fitted = fitted_device(device, fit_constants(
        [fit_columns(c.setup, device, 8) for _, c, _, _ in rows],
        [m.step_s for _, _, m, _ in rows], prior_constants(device)))
    print(f"fit: {fitted.efficiency * 1e3:.3g} GFLOP/s effective, "
          f"{fitted.intra.gb_per_s:.3g} GB/s, latency {fitted.intra.latency_us:.3g} us, "
          f"{fitted.block_pass_us:.3g} us per block pass")
    print("| layout | est. tensor peak MiB | measured MiB | error | predicted s | measured s |")
    print("|---|---|---|---|---|---|")
    pred, meas, errors = [], [], []
    for name, c, m, peak in rows:
        est = estimate_memory(c.setup).peak_bytes
        t = step_time(c.setup, fitted, 8).total
        pred.append(t)
        meas.append(m.step_s)
        errors.append(est / peak - 1)
        print(f"| {name} | {est / 2**20:.1f} | {peak / 2**20:.1f} | {est / peak - 1:+.0%} "
              f"| {t:.3f} | {m.step_s:.3f} |")
    print(f"max |memory error| {max(abs(e) for e in errors):.0%}; Spearman rho "
          f"{spearman(pred, meas):.2f} ({len(rows)} layouts)")
    (Path(ns.out) / "results.json").write_text(json.dumps(
        [{"layout": name, "keys": c.keys, "measured_s": m.step_s, "predicted_s": t,
          "estimated_bytes": estimate_memory(c.setup).peak_bytes, "measured_bytes": peak}
         for (name, c, m, peak), t in zip(rows, pred)], indent=1))


if __name__ == "__main__":
    main()
