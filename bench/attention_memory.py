"""Peak memory and time of one attention call over a packed row: FlexAttention with the
documents' block mask against SDPA with the dense mask (``models/attention.py``'s two
paths), each kind in its own process.

    python bench/attention_memory.py [--seq 8192] [--docs 16] [--heads 8] [--kv-heads 2]
                                     [--head-dim 64] [--device cpu] [--json FILE]

On the CPU the peak is the process's resident set (``VmHWM``), reset after the inputs
exist and after a first, warm-up call (flex is compiled there, which costs memory once);
on a GPU it is ``torch.cuda.max_memory_allocated`` over the same call. Forward only (the
CPU has no FlexAttention backward), fp32, no gradients: the figure is the call's working
memory, the mask included.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def _rss_peak_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _reset_peak(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    else:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS


def _peak_mib(device) -> float:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() / 2**20
    return _rss_peak_mib()


def measure(kind: str, args) -> dict:
    """One kind's call, in this process."""
    import torch

    from lmforge.models.attention import DocumentMask, attend

    device = torch.device(args.device)
    torch.manual_seed(0)
    segments = torch.repeat_interleave(torch.arange(args.docs), args.seq // args.docs)
    segments = torch.cat([segments, segments.new_full((args.seq - len(segments),), args.docs)])
    q = torch.randn(1, args.heads, args.seq, args.head_dim, device=device)
    k = torch.randn(1, args.kv_heads, args.seq, args.head_dim, device=device)
    v = torch.randn_like(k)
    with torch.no_grad():
        attend(q, k, v, DocumentMask(segments[None].to(device), kind))  # warm-up / compile
        mask = DocumentMask(segments[None].to(device), kind)  # a new batch: built again
        _reset_peak(device)
        before = _peak_mib(device)
        start = time.perf_counter()
        out = attend(q, k, v, mask)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        peak = _peak_mib(device)
    return {"kind": kind, "peak_mib": round(peak, 1), "above_inputs_mib": round(peak - before, 1),
            "seconds": round(seconds, 4), "out_norm": float(out.norm())}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--docs", type=int, default=16)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args)))
        return 0
    rows = []
    for kind in ("sdpa", "flex"):
        proc = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--child", kind],
                              capture_output=True, text=True, check=True)
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    import torch

    result = {"device": args.device, "torch": torch.__version__, "seq": args.seq,
              "docs": args.docs, "heads": args.heads, "kv_heads": args.kv_heads,
              "head_dim": args.head_dim, "rows": rows}
    print(f"one attention call, seq {args.seq}, {args.docs} documents, {args.heads} heads "
          f"({args.kv_heads} kv) x {args.head_dim}, fp32, {args.device}, torch "
          f"{torch.__version__}")
    print("| kind | peak MiB | above the inputs MiB | seconds |\n|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['kind']} | {r['peak_mib']:.1f} | {r['above_inputs_mib']:.1f} | "
              f"{r['seconds']:.4f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
