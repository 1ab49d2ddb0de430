"""``lmforge estimate`` (memory before launch) and ``lmforge report`` (after the run)."""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

from lmforge import fsio
from lmforge.cli.common import config_and_overrides
from lmforge.config import AUTO, load_config, save_config
from lmforge.perf.auto_batch import describe, pick_micro_batch, plan_auto, with_micro_batch
from lmforge.perf.budget import Budget
from lmforge.perf.estimate import GiB, estimate_memory, format_table, max_micro_batch
from lmforge.perf.calibrate import (fit_columns, fit_constants, fitted_device,
                                    load_calibration, measure, prior_constants,
                                    save_calibration, spearman)
from lmforge.perf.estimate_setup import setup_from_config
from lmforge.perf.layout_search import MEMORY_MARGIN, fixes, no_fit_message, plan, with_keys
from lmforge.perf.report import write_report
from lmforge.perf.timing import DEVICES, known_device, step_time


def add_parser(sub) -> None:
    _add_estimate(sub)
    _add_plan(sub)
    _add_report(sub)


def _add_estimate(subparsers) -> None:
    p = subparsers.add_parser(
        "estimate", help="peak memory per device for a config, before launch",
        description="Estimate the peak memory per device of a training config (parameters, "
        "gradients, optimizer states, activations, LoRA/QLoRA base, framework overhead) "
        "without allocating the model. docs/estimate.md explains the model.")
    p.add_argument("config", nargs="?", help="YAML recipe (default: the embedded demo)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="config overrides, e.g. data.micro_batch_size=4")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--device-memory-gib", type=float, default=None, metavar="G",
                   help="device memory to fit: reports the largest micro-batch that fits")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="device the run will use (default: train.device; auto = this "
                   "machine's)")
    p.add_argument("--world-size", type=int, default=None,
                   help="devices in the job, to resolve parallel.dp_shard=-1")
    p.add_argument("--base-dtype", choices=("fp32", "bf16"), default=None,
                   help="storage of a LoRA run's frozen, unquantized weights (default "
                   "fp32, as the trainer loads them)")
    p.add_argument("--attention", choices=("sdpa", "eager"), default="sdpa",
                   help="eager: HF-style attention keeping the S x S probabilities "
                   "(for comparing with such runs)")
    p.set_defaults(func=_estimate)


def _estimate(ns) -> int:
    cfg = load_config(*config_and_overrides(ns.config, ns.overrides))
    if ns.world_size is not None and ns.world_size < 1:
        raise ValueError(f"--world-size: must be >= 1, got {ns.world_size}")
    if ns.device_memory_gib is not None and not ns.device_memory_gib > 0:
        raise ValueError(f"--device-memory-gib: must be > 0, got {ns.device_memory_gib}")
    if cfg.data.micro_batch_size == AUTO and ns.device_memory_gib is not None:
        cfg = _size_for(cfg, ns)
    setup = setup_from_config(cfg, device=ns.device, world_size=ns.world_size,
                              attention=ns.attention, base_dtype=ns.base_dtype)
    est = estimate_memory(setup)
    fit = (max_micro_batch(setup, ns.device_memory_gib)
           if ns.device_memory_gib is not None else None)
    if ns.json:
        out = est.as_dict()
        if ns.device_memory_gib is not None:
            out["device_memory_gib"] = ns.device_memory_gib
            out["fits"] = est.total_bytes <= ns.device_memory_gib * GiB
            out["max_micro_batch"] = fit
        json.dump(out, sys.stdout, indent=2)
        print()
    else:
        print(format_table(est, ns.device_memory_gib, fit))
    if ns.device_memory_gib is None or est.total_bytes <= ns.device_memory_gib * GiB:
        return 0
    changes = fixes(cfg, setup.layout.world_size, ns.device_memory_gib)
    print(f"lmforge estimate: does not fit {ns.device_memory_gib:g} GiB; changes that make "
          f"it fit: {'; '.join(changes) or 'none of one step (see lmforge plan)'}",
          file=sys.stderr)
    return 1


def _size_for(cfg, ns):
    """data.micro_batch_size=auto sized to --device-memory-gib (as ``lmforge train``
    sizes it to its GPU), with the line that says so."""
    p = cfg.parallel
    world = ns.world_size or p.dp_replicate * p.tp * p.pp * p.cp * max(p.dp_shard, 1)
    budget = Budget(ns.device_memory_gib * GiB, "--device-memory-gib")
    auto = pick_micro_batch(cfg, world, budget, device=ns.device)
    print(describe(auto), file=sys.stderr)
    return with_micro_batch(cfg, auto.micro_batch)


def _add_plan(subparsers) -> None:
    p = subparsers.add_parser(
        "plan", help="the fastest parallel layout that fits, predicted",
        description="Enumerate every legal layout (data/tensor/pipeline parallel sizes, "
        "schedule, micro-batch, checkpointing, ZeRO stage, chunked loss) of a config on N "
        "GPUs, keep those whose estimated memory fits, and rank them by an analytical step "
        "time. docs/plan.md explains the model.")
    p.add_argument("config", nargs="?", help="YAML recipe (default: the embedded demo)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="config overrides, e.g. data.global_batch_size=64")
    p.add_argument("--gpus", type=int, required=True, help="devices in the job")
    p.add_argument("--gpus-per-node", type=int, default=8, help="devices per node")
    p.add_argument("--device", default="h100", help=f"one of {', '.join(DEVICES)}")
    p.add_argument("--top", type=int, default=10, metavar="K", help="rows to print")
    p.add_argument("--output", default=None, metavar="PLAN.yaml",
                   help="write the winner as a config `lmforge train` loads")
    p.add_argument("--calibrate", action="store_true",
                   help="run the top K candidates a few steps here (torchrun, --gpus "
                   "processes), fit the efficiency and link bandwidth to their step times, "
                   "save them (--calibration) and print predicted vs measured")
    p.add_argument("--calibration", default=None, metavar="FILE.json",
                   help="constants fitted by --calibrate: read them (plan) or write them "
                   "(with --calibrate; default OUT/calibration.json)")
    p.add_argument("--calibrate-steps", type=int, default=4, metavar="N",
                   help="steps per calibration run; the first is not timed")
    p.add_argument("--calibrate-dir", default="lmforge-calibrate", metavar="OUT",
                   help="where calibration runs write")
    p.set_defaults(func=_plan)


def _device(ns):
    """(name, Device): the named one, or the one a calibration file holds."""
    name, device = ns.device, known_device(ns.device)
    if ns.calibration and not ns.calibrate:
        name, device = load_calibration(Path(ns.calibration))
    if not device.calibrated and not ns.calibrate:
        raise ValueError(f"--device {name}: no step-time constants for it (a CPU's FLOP rate "
                         "and transport are not on a data sheet); run with --calibrate, or "
                         "--calibration FILE from an earlier --calibrate")
    if device.memory_gib <= 0:  # the CPU: this machine's RAM, shared by its processes
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        device = dataclasses.replace(device, memory_gib=ram / min(ns.gpus, ns.gpus_per_node))
    return name, device


def _plan(ns) -> int:
    if ns.gpus < 1 or ns.gpus_per_node < 1:
        raise ValueError("--gpus and --gpus-per-node: must be >= 1")
    if ns.gpus > ns.gpus_per_node and ns.gpus % ns.gpus_per_node:
        raise ValueError(f"--gpus: {ns.gpus} is not a multiple of --gpus-per-node "
                         f"{ns.gpus_per_node} (whole nodes only)")
    _check_plan_outputs(ns)
    name, device = _device(ns)
    per_node = ns.gpus_per_node
    cfg = load_config(*config_and_overrides(ns.config, ns.overrides))
    search = plan_auto if cfg.data.micro_batch_size == AUTO else plan  # (auto: the largest)
    result = search(cfg, ns.gpus, per_node, device)
    if not result.candidates:
        raise ValueError(no_fit_message(cfg, ns.gpus, per_node, device, name))
    if ns.calibrate:
        return _calibrate(ns, cfg, result.candidates[:ns.top], name, device)
    print(f"{len(result.candidates)} of {result.tried} legal layouts fit {name} "
          f"({device.memory_gib:g} GiB, {MEMORY_MARGIN:.0%} kept free); fastest first:")
    print(f"{'layout':52s}{'GiB':>7s}{'step s':>9s}{'tok/s/dev':>11s}{'MFU':>7s}  largest")
    for c in result.candidates[:ns.top]:
        t = c.time
        print(f"{c.describe():52s}{c.peak_gib:7.1f}{t.total:9.3f}{t.tokens_per_s:11.0f}"
              f"{t.mfu:7.1%}  {t.largest}")
    if ns.output:
        save_config(with_keys(cfg, result.candidates[0].keys), ns.output)
        print(f"wrote {ns.output}")
    return 0


def _check_plan_outputs(ns) -> None:
    """Refuse an output that cannot be written before the search (or the runs) start."""
    config = [("CONFIG", ns.config)]
    if ns.output:
        fsio.check_apart(ns.output, "--output", config)
        fsio.check_writable(ns.output, "--output")
    if ns.calibrate:
        fsio.check_apart(ns.calibrate_dir, "--calibrate-dir", config)
        fsio.check_writable(ns.calibrate_dir, "--calibrate-dir", kind="dir")
        if ns.calibration:
            fsio.check_apart(ns.calibration, "--calibration", config)
            fsio.check_writable(ns.calibration, "--calibration")


def _calibrate(ns, cfg, candidates, name, device) -> int:
    """Run ``candidates``, fit, save, and print predicted vs measured before and after."""
    root = Path(ns.calibrate_dir)
    rows = []
    for i, c in enumerate(candidates):
        m = measure(ns.config, ns.overrides, c.keys, root / f"cand{i}", ns.gpus,
                    ns.calibrate_steps)
        print(f"ran {c.describe()}: " + (f"{m.step_s:.3f} s/step, peak_mem_gib "
                                         f"{m.peak_mem_gib:.2f}" if m.step_s else m.error))
        rows.append((c, m))
    ok = [(c, m) for c, m in rows if m.step_s]
    if not ok:
        raise ValueError("--calibrate: no candidate ran; see the errors above")
    fitted = fitted_device(device, fit_constants(
        [fit_columns(c.setup, device, ns.gpus_per_node) for c, _ in ok],
        [m.step_s for _, m in ok], prior_constants(device)))
    units = "" if device.calibrated else " (reference units, not a prediction)"
    print(f"fit: {describe_fit(device, fitted)}")
    print(f"{'layout':52s}{'before s' + units:>10s}{'after s':>9s}{'measured':>10s}"
          f"{'est GiB':>9s}{'peak_mem_gib':>14s}")
    saved, after, measured = [], [], []
    for c, m in ok:
        t = step_time(c.setup, fitted, ns.gpus_per_node).total
        after.append(t)
        measured.append(m.step_s)
        print(f"{c.describe():52s}{c.time.total:10.3f}{t:9.3f}{m.step_s:10.3f}"
              f"{c.peak_gib:9.3f}{m.peak_mem_gib or float('nan'):14.3f}")
        saved.append({"layout": c.describe(), "keys": c.keys, "measured_s": m.step_s,
                      "before_s": c.time.total, "after_s": t, "estimated_gib": c.peak_gib,
                      "peak_mem_gib": m.peak_mem_gib})
    if len(ok) > 1:
        print(f"Spearman rho (after vs measured): {spearman(after, measured):.2f}")
    path = Path(ns.calibration) if ns.calibration else root / "calibration.json"
    save_calibration(path, name, fitted, saved)
    print(f"wrote {path}")
    return 0


def describe_fit(before, after) -> str:
    """The fitted constants, and the priors they replace."""
    return (f"efficiency {before.efficiency:g} -> {after.efficiency:.4g} of "
            f"{after.peak_flops / 1e12:g} TFLOP/s; intra-node {before.intra.gb_per_s:g} -> "
            f"{after.intra.gb_per_s:.4g} GB/s, latency {before.intra.latency_us:g} -> "
            f"{after.intra.latency_us:.4g} us; per block pass {before.block_pass_us:g} -> "
            f"{after.block_pass_us:.4g} us")


def _add_report(subparsers) -> None:
    p = subparsers.add_parser(
        "report", help="plots and a Markdown summary of one or more runs",
        description="Plot loss (vs step and vs tokens), held-out loss, learning rate, "
        "gradient norm, tokens/s, memory and MFU of one run or several overlaid, and write a "
        "Markdown summary: a row per run, and a column per config value that differs "
        "between the runs. Plots need matplotlib (pip install -e '.[report]').")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories "
                   "(train.output_dir, holding metrics.jsonl)")
    p.add_argument("--output", default=None, metavar="DIR",
                   help="where to write (default: RUN_DIR/report for one run, "
                   "./lmforge-report for several)")
    p.set_defaults(func=_report)


def _report(ns) -> int:
    result = write_report(ns.runs, ns.output)
    for path in result["plots"].values():
        print(path)
    print(result["summary"])
    if result["missing"]:
        print(f"lmforge report: {result['missing']}", file=sys.stderr)
        return 1
    return 0
