"""The output layer + loss, four ways: plain (the whole micro-batch's logits), chunked
(train.loss_chunk_tokens: each chunk checkpointed, its logits recomputed in backward),
fused (train.fused_loss: the summed loss's gradients made in the forward pass) and fused
per-token (the log-probabilities the preference and GRPO objectives weight token by
token: each chunk's logits recomputed once in backward). Two modes:

    python bench/loss_heads.py head --tokens 2048 --dim 256 --vocab 32000 --device cpu
    python bench/loss_heads.py steps --device cuda      # the 1B at seq 2048 (gpu_check)

``head``: the head alone on random hidden states, forward + backward, timed (median and
best after warm-up) with its peak memory beyond the inputs (CUDA: the allocator's peak;
CPU: live tensor bytes in one untimed pass, perf/tracker.py). ``steps``:
bench/train_step.py's lmforge side for llama3.2-1b at seq 2048, compiled, for each loss at
micro-batch 1 and 8 (``STEP_ROWS``): tokens/s, MFU and peak memory, a failure (out of
memory) as its row's error.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from lmforge import IGNORE_INDEX  # noqa: E402
from lmforge.models.fused_loss import fused_loss_sum, fused_token_logps  # noqa: E402
from lmforge.models.loss import chunked_loss_sum, token_loss_sum  # noqa: E402
from lmforge.perf.tracker import TensorMemoryTracker  # noqa: E402

HEADS = ("plain", "chunked", "fused", "fused per-token")
# (loss, micro-batch) rows of ``steps``: the loss flags of bench/train_step.py
STEP_ROWS = [("plain", 1), ("chunked", 1), ("fused", 1),
             ("plain", 8), ("chunked", 8), ("fused", 8)]
LOSS_FLAGS = {"plain": [], "chunked": ["--loss-chunk-tokens", "1024"],
              "fused": ["--fused-loss", "--loss-chunk-tokens", "1024"]}


def head_loss(kind: str, output, hidden, labels, chunk: int, autocast) -> torch.Tensor:
    """The summed token loss of ``kind``; ``fused per-token`` sums the per-token
    log-probabilities under a per-token gradient (what DPO and GRPO send back)."""
    if kind == "plain":
        with autocast():
            logits = output(hidden)
        return token_loss_sum(logits, labels)
    if kind == "chunked":
        return chunked_loss_sum(output, hidden, labels, chunk, autocast)
    if kind == "fused":
        return fused_loss_sum(output, hidden, labels, chunk, autocast)
    return -fused_token_logps(output, hidden, labels, chunk, autocast).sum()


def time_head(kind: str, args, device: torch.device) -> dict:
    g = torch.Generator().manual_seed(0)
    dtype = torch.float32
    torch.manual_seed(0)  # (the same head for every kind)
    output = torch.nn.Linear(args.dim, args.vocab, bias=False).to(device)
    hidden = torch.randn(args.tokens, args.dim, generator=g).to(device, dtype)
    hidden.requires_grad_(True)
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=g).to(device)
    labels[: args.tokens // 10] = IGNORE_INDEX  # a prompt's worth without a target
    autocast = ((lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.type == "cuda"
                else (lambda: torch.autocast("cpu", enabled=False)))
    tracker = TensorMemoryTracker()  # (one untimed pass: the tracker slows every op)
    tracker.track([output.weight, hidden, labels])
    with tracker:
        head_loss(kind, output, hidden, labels, args.chunk, autocast).backward()
    peak, times = tracker.peak - tracker_inputs(output.weight, hidden, labels), []
    for i in range(args.warmup + args.steps):
        hidden.grad = output.weight.grad = None
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        loss = head_loss(kind, output, hidden, labels, args.chunk, autocast)
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    return {"head": kind, "ms": 1e3 * seconds, "best_ms": 1e3 * min(times),
            "tokens_per_s": args.tokens / seconds,
            "peak_mib": peak / 2**20, "loss": float(loss.detach())}


def tracker_inputs(*tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


def run_heads(args) -> list[dict]:
    device = torch.device(args.device)
    rows = [time_head(kind, args, device) for kind in HEADS]
    logits_mib = 4 * args.tokens * args.vocab / 2**20
    print(f"head {args.tokens} tokens x dim {args.dim} -> vocab {args.vocab} (fp32 logits "
          f"{logits_mib:.0f} MiB), chunk {args.chunk}, {args.steps} timed steps, on "
          f"{device_name(device)}")
    print("| head | ms (fwd+bwd), median | best | tokens/s | peak MiB beyond inputs | loss |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['head']} | {r['ms']:.1f} | {r['best_ms']:.1f} | {r['tokens_per_s']:,.0f} | "
              f"{r['peak_mib']:.1f} | {r['loss']:.4f} |")
    return rows


def run_steps(args) -> list[dict]:
    """bench/train_step.py's lmforge side (one process per row) for each STEP_ROWS."""
    rows = []
    for loss, batch in STEP_ROWS:
        if args.only and loss not in args.only:
            continue
        rows.append(step_row(loss, batch, args.device, args.timeout_s))
        print(json.dumps(rows[-1]), flush=True)
        if args.json:  # after each row: a caller cut off at its time limit keeps them
            Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    return rows


def step_row(loss: str, batch: int, device: str, timeout_s: int,
             steps: tuple = ("--steps", "6", "--warmup", "2")) -> dict:
    """One lmforge-side run of bench/train_step.py: llama3.2-1b, seq 2048, compiled."""
    cmd = [sys.executable, str(ROOT / "bench" / "train_step.py"), "--preset", "llama3.2-1b",
           "--seq-len", "2048", "--batch", str(batch), "--compile", *LOSS_FLAGS[loss],
           *steps, "--device", device, "--side", "lmforge"]
    row = {"loss": loss, "micro_batch": batch}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0:
            lines = [x for x in proc.stderr.strip().splitlines() if x.strip()]
            raise RuntimeError(lines[-1] if lines else f"exit status {proc.returncode}")
        row.update(json.loads(proc.stdout.strip().splitlines()[-1]))
    except Exception as e:  # (out of memory at micro-batch 8 is a finding, not a crash)
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return row


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({os.cpu_count()} cores)"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=("head", "steps"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--only", nargs="+", choices=tuple(LOSS_FLAGS), help="steps: these losses")
    p.add_argument("--timeout-s", type=int, default=300, help="steps: per row")
    p.add_argument("--json", help="also write the rows here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = run_heads(args) if args.mode == "head" else run_steps(args)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
