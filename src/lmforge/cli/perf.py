"""``lmforge estimate`` (memory before launch) and ``lmforge report`` (after the run)."""
from __future__ import annotations

import json
import sys

from lmforge.cli.common import config_and_overrides
from lmforge.config import load_config, save_config
from lmforge.perf.estimate import GiB, estimate_memory, format_table, max_micro_batch
from lmforge.perf.estimate_setup import setup_from_config
from lmforge.perf.plan import MEMORY_MARGIN, fixes, no_fit_message, plan, with_keys
from lmforge.perf.report import write_report
from lmforge.perf.timing import DEVICES, known_device


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
    changes = fixes(cfg, setup.world_size, ns.device_memory_gib)
    print(f"lmforge estimate: does not fit {ns.device_memory_gib:g} GiB; changes that make "
          f"it fit: {'; '.join(changes) or 'none of one step (see lmforge plan)'}",
          file=sys.stderr)
    return 1


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
    p.add_argument("--gpus-per-node", type=int, default=8, help="devices per node (8)")
    p.add_argument("--device", default="h100", help=f"one of {', '.join(DEVICES)}")
    p.add_argument("--top", type=int, default=10, metavar="K", help="rows to print (10)")
    p.add_argument("--output", default=None, metavar="PLAN.yaml",
                   help="write the winner as a config `lmforge train` loads")
    p.set_defaults(func=_plan)


def _plan(ns) -> int:
    device = known_device(ns.device)
    if ns.gpus < 1 or ns.gpus_per_node < 1:
        raise ValueError("--gpus and --gpus-per-node: must be >= 1")
    if ns.gpus > ns.gpus_per_node and ns.gpus % ns.gpus_per_node:
        raise ValueError(f"--gpus: {ns.gpus} is not a multiple of --gpus-per-node "
                         f"{ns.gpus_per_node} (whole nodes only)")
    per_node = ns.gpus_per_node
    cfg = load_config(*config_and_overrides(ns.config, ns.overrides))
    result = plan(cfg, ns.gpus, per_node, device)
    if not result.candidates:
        raise ValueError(no_fit_message(cfg, ns.gpus, per_node, device, ns.device))
    print(f"{len(result.candidates)} of {result.tried} legal layouts fit {ns.device} "
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


def _add_report(subparsers) -> None:
    p = subparsers.add_parser(
        "report", help="plots and a Markdown summary of one or more runs",
        description="Plot loss (vs step and vs tokens), tokens/s, memory and MFU of one run "
        "or several overlaid, and write a Markdown summary table.")
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
