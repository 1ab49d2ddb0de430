"""Issue 40's GPU measurements as one script: every prepared call of docs/benchmarks.md
("Prepared, not yet measured"), most telling first, each in its own process, as many as
fit the time given; the rest wait for the next GPU.

    python3 bench/speed_gpu.py --out $OUT --budget-s 540            # on the GPU machine
    python3 bench/speed_gpu.py --out $OUT --done OLD/speed_gpu.jsonl # skip what ran before
    python3 bench/speed_gpu.py --dry-run                               # the plan, no run
    python3 bench/speed_gpu.py --out $OUT --only moe-30b               # the MoE rows alone

A step starts only if its expected seconds fit what is left of the budget; it is stopped
at the budget's end. Each step's output goes to ``OUT/<step>.log`` and one JSON line per
step to ``OUT/speed_gpu.jsonl`` as it ends (name, exit status, seconds, the command), so a
call cut short keeps what it measured. The 7B rows' reference needs bitsandbytes: a wheel
under ``.whl/`` is installed into a private folder first (docs/benchmarks.md).

The MoE rows (``moe-30b-*``): Qwen3-30B-A3B with LoRA (rank 16, ``all-linear``: the
attention and the experts) at seq 2048, lmforge against transformers 5 (grouped_mm
experts) + peft (``target_modules`` on the attention, ``target_parameters`` on the
experts), both with a bf16 base and fp32 adapters, each side's own random weights (30B
are too many to write for both): peak memory (to set beside Unsloth's published 63 GB
for this model's bf16 LoRA) and tokens/s; with and without activation checkpointing.
``--only moe-30b`` runs them first when a GPU is lent.

The expert-parallel rows (``moe-30b-ep8``, ``moe-30b-fsdp8``) need 8 GPUs: Qwen3-30B-A3B
fully trained (fp32 weights, bf16 autocast, full activation checkpointing, the fused
loss) at seq 4096, micro-batch 2 per GPU, by ``bench/ep_bench.py``, which launches
``torchrun --nproc-per-node 8 -m lmforge.cli train``: ``parallel.ep=8
parallel.dp_shard=8`` (16 experts whole on each GPU, tokens sent by all-to-all) and,
to set beside it, FSDP2 alone (``parallel.dp_shard=8``); tokens/s per GPU, to compare
with torchtitan's default all-to-all at ep=8 (9,930 tokens/s per GPU, docs/benchmarks.md).
With fewer GPUs visible such a step is skipped with one line (and a ``"rc": "skipped"``
record); it takes none of the budget.

The hybrid rows (``hybrid-9b-*``): Qwen3.5-9B with the recipe's LoRA at seq 4096, lmforge
against transformers + peft, first with both on their PyTorch delta rules, then with
flash-linear-attention's kernels installed for the step (``.whl/fla_core*.whl`` and
``einops*.whl``, pure Python: ``pip download --no-deps -d .whl fla-core==0.6.0 einops``),
both on its Triton kernels.
``--only hybrid`` runs them first.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
BENCH = "bench"
ONE_B = ["--preset", "llama3.2-1b", "--compile", "--fused-loss"]
MOE_30B_LORA = ["--preset", "qwen3-30b-a3b", "--method", "lora", "--lora-rank", "16",
                "--lora-targets", "all-linear", "--base-dtype", "bf16", "--random-weights",
                "--seq-len", "2048", "--batch", "1", "--steps", "4", "--warmup", "2"]
BNB = ("bitsandbytes",)
# flash-linear-attention's kernels: fla-core (pure Python: its Triton kernels compile on
# use) and its one dependency, einops; fla.ops needs nothing of the layers' package
FLA = ("fla_core", "einops")
# Qwen3.5-9B (24 Gated DeltaNet layers, 8 gated full-attention ones) with the recipe's
# LoRA (configs/qwen3.5-9b-lora.yaml: all-linear rank 16, a bf16 base, every block
# checkpointed) at seq 4096, lmforge against transformers + peft, each side's own random
# weights: without FLA both run their PyTorch delta rules, with its wheels both its kernels
HYBRID_9B_LORA = ["--preset", "qwen3.5-9b", "--method", "lora", "--lora-rank", "16",
                  "--lora-targets", "all-linear", "--base-dtype", "bf16", "--random-weights",
                  "--seq-len", "4096", "--batch", "1", "--activation-checkpointing",
                  "--steps", "4", "--warmup", "2"]
EP_GPUS = 8
MOE_30B_EP = ["--device", "cuda", "--nproc", str(EP_GPUS), "--preset", "qwen3-30b-a3b",
              "--shape", "preset", "--seq-len", "4096", "--batch", "2", "--steps", "6",
              "--warmup", "3", "--activation-checkpointing", "--set", "train.fused_loss=true"]


@dataclass(frozen=True)
class Step:
    name: str
    argv: tuple  # after the python executable, from the repository root
    expect_s: int  # what it should take on an H100/H200 (compiles included)
    # packages whose wheels under .whl/ it installs first (the GPU image lacks them)
    wheels: tuple[str, ...] = ()
    gpus: int = 1  # GPUs it needs visible (more: torchrun inside the step)


def steps(out: str) -> list[Step]:
    """The calls, most telling first (issue 40's "done when" order)."""
    train_step = (f"{BENCH}/train_step.py",)
    seven_b = (f"{BENCH}/seven_b.py", "--out", f"{out}/seven_b.jsonl")
    return [
        Step("headline-2048", train_step + (*ONE_B, "--seq-len", "2048", "--batch",
             "16,8,4,2,1", "--reference-compile", "--steps", "6", "--warmup", "2",
             "--json", f"{out}/headline-2048.json"), 240),
        Step("profile-and-auto", (f"{BENCH}/gpu_check.py", "--only", "profile", "micro_batch",
             "--no-benches", "--out", "/tmp/gc", "--report-dir", f"{out}/gpu_check",
             "--budget-s", "300"), 300),
        Step("fused-loss", (f"{BENCH}/loss_heads.py", "steps", "--json",
             f"{out}/loss_heads.json"), 240),
        Step("headline-8192", train_step + (*ONE_B, "--seq-len", "8192", "--batch", "4,2,1",
             "--reference-compile", "--steps", "4", "--warmup", "2",
             "--json", f"{out}/headline-8192.json"), 240),
        *[Step(f"compile-{tag}", train_step + (*ONE_B[:2], "--seq-len", "2048", "--batch",
               "8", "--fused-loss", "--lmforge-only", "--steps", "6", "--warmup", "2",
               *flags, "--json", f"{out}/compile-{tag}.json"), 120)
          for tag, flags in (("blocks", ("--compile",)), ("whole", ("--compile-whole",)),
                             ("foreach-adamw", ("--compile", "--adamw", "foreach")))],
        Step("7b-qlora", seven_b + ("--rows", "qlora"), 300, wheels=BNB),
        Step("7b-int8-b1-b4", seven_b + ("--rows", "int8-b1", "int8-b4", "--budget-s", "300"),
             330, wheels=BNB),
        Step("7b-int8-b7", seven_b + ("--rows", "int8-b7"), 240, wheels=BNB),
        Step("7b-full-low-memory", seven_b + ("--rows", "full-low-memory"), 300),
        # the MoE issue's GPU rows: run them with --only moe-30b
        *[Step(f"moe-30b-lora-2048{tag}", train_step + (*MOE_30B_LORA, *flags, "--json",
               f"{out}/moe-30b-lora-2048{tag}.json"), 420)
          for tag, flags in (("", ()), ("-ac", ("--activation-checkpointing",)))],
        # the hybrid issue's GPU rows (Qwen3.5): the PyTorch rules, then FLA's kernels
        *[Step(f"hybrid-9b-lora-4096{tag}", train_step + (*HYBRID_9B_LORA, "--json",
               f"{out}/hybrid-9b-lora-4096{tag}.json"), 360, wheels=wheels)
          for tag, wheels in (("", ()), ("-fla", FLA))],
        # expert parallelism against FSDP2 alone on 8 GPUs (skipped with fewer)
        *[Step(f"moe-30b-{name}", (f"{BENCH}/ep_bench.py", *MOE_30B_EP, "--layouts", layout,
               "--json", f"{out}/moe-30b-{name}.json"), 300, gpus=EP_GPUS)
          for name, layout in ((f"ep{EP_GPUS}", "ep"), (f"fsdp{EP_GPUS}", "fsdp"))],
    ]


def runnable(plan: list[Step], done: set[str], budget_s: float,
             gpus: Optional[int] = None) -> list[Step]:
    """The steps not done before, in order, each as long as the ones before it leave time
    for its expected seconds (a later, shorter one may still fit); with ``gpus`` (those
    visible), none that needs more of them."""
    chosen, left = [], budget_s
    for step in plan:
        if step.name in done or step.expect_s > left or not fits(step, gpus):
            continue
        chosen.append(step)
        left -= step.expect_s
    return chosen


def fits(step: Step, gpus: Optional[int]) -> bool:
    """Whether ``step`` can run with ``gpus`` visible (None: not asked, it may)."""
    return gpus is None or step.gpus <= max(gpus, 1)


def gpus_visible() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def only(plan: list[Step], prefixes) -> list[Step]:
    """The steps whose names start with one of ``prefixes`` (all when there are none)."""
    return [s for s in plan if not prefixes or s.name.startswith(tuple(prefixes))]


def done_before(path) -> set[str]:
    """Names of the steps that ended with status 0 in an earlier call's speed_gpu.jsonl."""
    if not path or not Path(path).is_file():
        return set()
    lines = (json.loads(line) for line in Path(path).read_text().splitlines() if line.strip())
    return {r["name"] for r in lines if r.get("rc") == 0}


def step_env(packages: tuple[str, ...]) -> dict:
    """The environment of a step: lmforge's sources on PYTHONPATH, and for a step that
    needs packages (bitsandbytes, flash-linear-attention) their wheels from ``.whl/``
    installed into a private folder first (nothing if there are none: they may be
    importable already)."""
    path = [str(ROOT / "src"), os.environ.get("PYTHONPATH")]
    wheels = sorted(w for package in packages for w in (ROOT / ".whl").glob(f"{package}*.whl"))
    if wheels:
        target = "/tmp/speed_gpu_site-" + "-".join(packages)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index",
                        "--no-deps", "--target", target, *map(str, wheels)], check=False)
        path.insert(0, target)
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, path)))


def run(step: Step, out: Path, seconds_left: float) -> dict:
    env = step_env(step.wheels)
    argv = [sys.executable, *step.argv]
    began = time.perf_counter()
    with open(out / f"{step.name}.log", "w") as log:
        try:
            rc = subprocess.run(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                timeout=max(1.0, seconds_left)).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    return {"name": step.name, "rc": rc, "seconds": round(time.perf_counter() - began, 1),
            "command": " ".join(step.argv)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "speed_gpu_out"))
    p.add_argument("--budget-s", type=float, default=540.0,
                   help="seconds for every step together (a device call allows 600)")
    p.add_argument("--done", help="an earlier call's speed_gpu.jsonl: skip its finished steps")
    p.add_argument("--only", nargs="+", metavar="NAME",
                   help="only the steps whose names start with these (e.g. moe-30b)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and stop")
    a = p.parse_args(argv)
    out = Path(a.out)
    chosen, done = only(steps(str(out)), a.only), done_before(a.done)
    visible = None if a.dry_run else gpus_visible()  # (dry: the plan for every GPU asked)
    plan = runnable(chosen, done, a.budget_s, visible)
    for step in plan:
        gpus = f"  [{step.gpus} GPUs]" if step.gpus > 1 else ""
        print(f"{step.name:<22} ~{step.expect_s:>4} s  python3 {' '.join(step.argv)}{gpus}")
    if a.dry_run:
        return 0
    out.mkdir(parents=True, exist_ok=True)
    for step in chosen:  # (a step that needs more GPUs: one line, no budget taken)
        if step.name not in done and not fits(step, visible):
            row = {"name": step.name, "rc": "skipped",
                   "reason": f"needs {step.gpus} GPUs, {visible} visible"}
            print(f"{step.name}: skipped, {row['reason']}", flush=True)
            with open(out / "speed_gpu.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
    deadline = time.monotonic() + a.budget_s
    for step in plan:
        left = deadline - time.monotonic()
        if left < step.expect_s:
            print(f"{step.name}: skipped, {left:.0f} s left of the budget", flush=True)
            continue
        row = run(step, out, left)
        with open(out / "speed_gpu.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
