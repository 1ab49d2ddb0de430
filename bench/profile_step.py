"""Where a training step's time goes: ``torch.profiler`` over the last steps of a real
``lmforge train`` run (bench/gpu_check.py's "profile" path runs it in its own process):

    python bench/profile_step.py --json prof.json --device cuda -- model.init_from=... train.compile=true ...

The run trains ``train.max_steps`` steps; the profiler records the last ``--active`` of
them (the first steps compile and warm up). On a GPU it reads the kernels (CUDA
activities), on the CPU the operators (CPU activities, so CI runs the same code). Written:
the ``--top`` kernels (operators) by their summed time, and the share of the recorded
window spent in matmul, attention, elementwise (every other kernel: pointwise, norms,
reductions, the optimizer's), other (copies, memsets, collectives) and idle (no kernel
running: launch gaps, host work, data). On the CPU "time" is each operator's self time on
the main thread, and idle is the window's wall time outside any operator.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

ATTENTION = re.compile(r"flash|fmha|attention|attn|sdpa|scaled_dot_product", re.I)
MATMUL = re.compile(r"gemm|matmul|cutlass|xmma|nvjet|cublas|aten::(mm|addmm|bmm|linear)\b"
                    r"|triton_tem_fused_.*mm|_mm_|sm90_|sm80_", re.I)
OTHER = re.compile(r"memcpy|memset|nccl|gloo|^aten::copy_$", re.I)
KINDS = ("matmul", "attention", "elementwise", "other")
# ranges that hold operators rather than being one: the profiler's step, compile stages
SCOPES = re.compile(r"^ProfilerStep|\(dynamo_timed\)$|^PythonDispatchMode$")


def kind(name: str) -> str:
    """matmul | attention | elementwise | other, by a kernel's (operator's) name;
    attention first (flash kernels hold gemm-like names)."""
    if ATTENTION.search(name):
        return "attention"
    if MATMUL.search(name):
        return "matmul"
    return "other" if OTHER.search(name) else "elementwise"


def summarize(events: list, device: str, window_s: float, top: int = 15) -> dict:
    """The ``top`` names by summed time and each kind's share of the window. ``events``:
    (name, start_us, duration_us) of each kernel (GPU) or operator's self time (CPU);
    ``window_s``: the recorded steps' wall time (the CPU's window; a GPU's is the span
    from its first kernel to its last)."""
    by_name: dict = defaultdict(float)
    for name, _, dur in events:
        by_name[name] += dur
    busy_us = _busy_us(events) if device == "cuda" else sum(d for _, _, d in events)
    span_us = _span_us(events) if device == "cuda" and events else window_s * 1e6
    total = sum(by_name.values()) or 1.0
    busy_share = min(busy_us / span_us, 1.0) if span_us else 0.0
    shares = {k: 0.0 for k in KINDS}
    for name, us in by_name.items():
        shares[kind(name)] += us / total * busy_share  # (overlapping streams: scaled)
    shares["idle"] = 1.0 - busy_share
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
    return {"device": device, "window_ms": span_us / 1e3, "busy_ms": busy_us / 1e3,
            "top": [{"name": n, "ms": us / 1e3, "share": us / total, "kind": kind(n)}
                    for n, us in ranked],
            "shares": shares}


def _busy_us(events: list) -> float:
    """The union of the kernels' intervals: time with at least one kernel running."""
    busy, end = 0.0, float("-inf")
    for _, start, dur in sorted(events, key=lambda e: e[1]):
        stop = start + dur
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy


def _span_us(events: list) -> float:
    return max(s + d for _, s, d in events) - min(s for _, s, _ in events)


def profiled_events(prof, device: str) -> list:
    """(name, start_us, duration_us): the GPU's kernels, or each CPU operator's self time."""
    from torch.autograd import DeviceType

    out = []
    for e in prof.events():
        if getattr(e, "is_user_annotation", False) or SCOPES.search(e.name):
            continue  # (a named range around ops or kernels, not one: counted twice else)
        if device == "cuda" and e.device_type == DeviceType.CUDA:
            if e.name.startswith("## "):  # (a compiled graph's range on the GPU's timeline)
                continue
            out.append((e.name, e.time_range.start, e.time_range.elapsed_us()))
        elif device == "cpu" and e.device_type == DeviceType.CPU:
            out.append((e.name, e.time_range.start, e.self_cpu_time_total))
    return out


def profile_run(overrides: list[str], device: str, active: int, top: int) -> dict:
    """Trains as ``lmforge train overrides`` would, the last ``active`` steps under the
    profiler (each step's end is the profiler's step: ``train.loop.train_step`` wrapped)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    from lmforge.config import load_config
    from lmforge.train import loop

    cfg = load_config(None, overrides)
    steps = cfg.train.max_steps
    warm = 1 if steps > active else 0
    activities = [ProfilerActivity.CUDA] if device == "cuda" else [ProfilerActivity.CPU]
    plan = schedule(wait=max(steps - active - warm, 0), warmup=warm, active=active, repeat=1)
    found: dict = {}
    window = []  # (start, end) wall time of the recorded steps
    step = loop.train_step

    def recorded(*args, **kwargs):
        started = time.perf_counter()
        result = step(*args, **kwargs)
        if device == "cuda":
            torch.cuda.synchronize()
        window.append((started, time.perf_counter()))
        prof.step()
        return result

    def ready(p) -> None:
        found["events"] = profiled_events(p, device)

    loop.train_step = recorded
    try:
        with profile(activities=activities, schedule=plan, on_trace_ready=ready) as prof:
            loop.train(cfg)
    finally:
        loop.train_step = step
    if "events" not in found:
        raise RuntimeError(f"the profiler recorded nothing ({steps} steps for {active} "
                           f"active ones)")
    last = window[-active:]
    return summarize(found["events"], device, sum(b - a for a, b in last), top)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", required=True, help="where the summary goes")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--active", type=int, default=3, help="steps recorded (the last ones)")
    p.add_argument("--top", type=int, default=15, help="kernels (operators) listed")
    p.add_argument("overrides", nargs="*", help="lmforge train's section.key=value")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    result = profile_run(args.overrides, args.device, args.active, args.top)
    Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
