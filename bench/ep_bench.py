"""Expert parallelism's cost: the same mixture of experts trained by ``lmforge train`` on
N processes with each MoE layer's experts split over the ranks (``parallel.ep=N
parallel.dp_shard=N``, tokens sent to their experts' ranks by all-to-all) against plain
FSDP2 data parallelism (``parallel.dp_shard=N``, every rank runs every expert, gathered
shard by shard), back to back in one invocation (same machine state).

    python bench/ep_bench.py                            # CPU: 2 processes (gloo), small shape
    python bench/ep_bench.py --json ep.json --steps 12 --warmup 3
    python bench/ep_bench.py --device cuda --nproc 8 --shape preset --layouts ep \\
        --seq-len 4096 --batch 2 --activation-checkpointing   # Qwen3-30B-A3B, 8 GPUs
    python bench/ep_bench.py ... --dry-run    # each run checked by lmforge train --dry-run

Each layout is one ``torchrun --standalone --nproc-per-node N -m lmforge.cli train`` on a
generated text corpus (random words, a BPE tokenizer trained on it once), random weights,
``train.log_every=1`` and no final save; its ``metrics.jsonl`` gives each step's tokens/s
(all ranks together) and peak memory (rank 0's: the CPU's peak resident set, a GPU's
peak allocated). The steps after ``--warmup`` are kept and their median reported, with
tokens/s per rank. On the CPU each process gets one thread (OMP_NUM_THREADS=1): 2
processes for 2 cores. ``--shape small`` (default) is Qwen3-30B-A3B's layout shrunk
(4 layers, dim 256, 32 experts top-8 of width 128) so a layout takes about a minute on a
2-core CPU; ``--shape preset`` keeps the preset's own; the shape flags replace fields
of either. With fewer GPUs than ``--nproc`` visible on ``--device cuda`` it prints one
line saying so and exits 0 (bench/speed_gpu.py's ep rows on a one-GPU machine).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import moe_bench  # noqa: E402

# Qwen3-30B-A3B's layout (every layer sparse, top-8, qk-norm) at a size a CPU steps in
# a fraction of a second
SMALL = {"dim": 256, "layers": 4, "heads": 4, "kv_heads": 2, "head_dim": 64,
         "experts": 32, "top_k": 8, "moe_ffn": 128, "ffn": 512, "vocab": 1024}
LAYOUTS = ("ep", "fsdp")
TOKENIZER_VOCAB = 1024  # (the small shape's vocabulary: the head's cost stays small)
# moe_bench's shape flag -> the ``model.*`` key of lmforge train
MODEL_KEYS = {"dim": "dim", "layers": "n_layers", "heads": "n_heads", "kv_heads": "n_kv_heads",
              "head_dim": "head_dim", "ffn": "ffn_dim", "vocab": "vocab_size",
              "experts": "n_experts", "top_k": "top_k", "moe_ffn": "moe_ffn_dim"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--shape", choices=("small", "preset"), default="small",
                   help="small: the preset shrunk to a CPU's size (4 layers, dim 256, 32 "
                        "experts top-8); preset: its own shape")
    p.add_argument("--nproc", type=int, default=2, help="processes (ranks); ep = dp_shard = this")
    p.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS),
                   help="ep: parallel.ep=N parallel.dp_shard=N; fsdp: parallel.dp_shard=N")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=4, help="micro-batch per rank")
    p.add_argument("--steps", type=int, default=10, help="timed steps (after the warm-up)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1,
                   help="launches per layout, alternated (ep, fsdp, ep, ...); the median "
                        "is over every round's timed steps")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--compile", action="store_true", help="train.compile (each block)")
    p.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                   help="more lmforge train overrides, for both layouts")
    p.add_argument("--timeout-s", type=float, default=900.0, help="per layout")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--dry-run", action="store_true",
                   help="check each layout's run with lmforge train --dry-run for --nproc "
                        "processes (no GPU needed) and stop")
    p.add_argument("--keep", help="run directories here (default: a temporary folder)")
    moe_bench.add_shape_flags(p)
    return p.parse_args(argv)


def shape_flags(a) -> argparse.Namespace:
    """The shape flags given, over the small shape's when ``--shape small``."""
    base = SMALL if a.shape == "small" else {}
    return argparse.Namespace(**{flag: getattr(a, flag) if getattr(a, flag) is not None
                                 else base.get(flag) for flag in moe_bench.SHAPE_FLAGS},
                              dense_layers=a.dense_layers)


def write_corpus(root: Path, tokens: int, seed: int = 0) -> tuple[Path, Path]:
    """A text file of random words (about ``tokens`` tokens once encoded) and a BPE
    tokenizer of TOKENIZER_VOCAB ids trained on it: (corpus, tokenizer directory)."""
    from lmforge.data.tokenizer import train_bpe

    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(3000)]
    lines, count = [], 0
    while count < tokens:
        line = " ".join(rng.choice(words) for _ in range(rng.randint(8, 40)))
        lines.append(line)
        count += len(line.split()) * 2  # (a generous guess at the tokens per word)
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(lines))
    tokenizer = root / "tok"
    train_bpe(lines[:2000], vocab_size=TOKENIZER_VOCAB).save(tokenizer)
    return corpus, tokenizer


def train_overrides(a, args, corpus: Path, tokenizer: Path) -> list[str]:
    """``lmforge train`` overrides shared by both layouts: the model's shape, the data,
    the batch, the steps, no final save."""
    flags = shape_flags(a)
    model = [f"model.preset={a.preset}", f"model.vocab_size={args.vocab_size}",
             f"model.max_seq_len={max(a.seq_len, args.max_seq_len)}"]
    model += [f"model.{MODEL_KEYS[flag]}={getattr(flags, flag)}" for flag in MODEL_KEYS
              if getattr(flags, flag) is not None and flag != "vocab"]
    return [*model, f"model.tokenizer={tokenizer}", "data.kind=text", f"data.path={corpus}",
            "data.eval_fraction=0", f"data.seq_len={a.seq_len}",
            f"data.micro_batch_size={a.batch}", f"data.global_batch_size={a.batch * a.nproc}",
            f"train.max_steps={a.warmup + a.steps}", "train.log_every=1", "train.save=false",
            "train.sample_tokens=0", "train.progress_bar=false", f"train.device={a.device}",
            *(["train.activation_checkpointing=full"] if a.activation_checkpointing else []),
            *(["train.compile=true"] if a.compile else []), *a.set]


def layout_overrides(layout: str, nproc: int) -> list[str]:
    return [f"parallel.dp_shard={nproc}"] + ([f"parallel.ep={nproc}"] if layout == "ep" else [])


def train_env(device: str) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    if device == "cpu":
        env["OMP_NUM_THREADS"] = "1"
    return env


def launch(out: Path, overrides: list[str], a) -> tuple[int, str, float]:
    """One ``torchrun ... lmforge.cli train``: (exit status, output's end, seconds)."""
    env = train_env(a.device)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={a.nproc}", "-m", "lmforge.cli", "train", *overrides,
           f"train.output_dir={out}"]
    began = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                              timeout=a.timeout_s)
        rc, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = "timeout", str(e.stdout or "")[-3000:]
    return rc, text[-3000:], time.perf_counter() - began


def summarize(records: list[dict], warmup: int, nproc: int) -> dict:
    """The median of the logged steps after ``warmup``: tokens/s (all ranks) and per
    rank, their range, and the peak memory logged last (rank 0's)."""
    timed = [r for r in records if r.get("step", 0) > warmup and r.get("tokens_per_s")]
    if not timed:
        return {"error": f"no step logged after the {warmup} warm-up steps"}
    rate = statistics.median(r["tokens_per_s"] for r in timed)
    return {"steps_timed": len(timed), "tokens_per_s": rate, "tokens_per_s_per_rank": rate / nproc,
            "tokens_per_s_min": min(r["tokens_per_s"] for r in timed),
            "tokens_per_s_max": max(r["tokens_per_s"] for r in timed),
            "peak_mem_gib_rank0": timed[-1].get("peak_mem_gib"),
            "final_loss": timed[-1].get("loss")}


def row_of(layout: str, a, runs: list[dict], records: list[dict]) -> dict:
    """A layout's row: the median over every round's timed steps, each round's, and the
    highest peak memory of any round."""
    name = f"ep={a.nproc} dp_shard={a.nproc}" if layout == "ep" else f"fsdp dp_shard={a.nproc}"
    failed = [r["rc"] for r in runs if r["rc"] != 0]
    row = {"name": name, "layout": layout, "nproc": a.nproc,
           "rc": failed[0] if failed else 0, "rounds": runs}
    if failed:
        return {**row, "error": f"exit {failed[0]}"}
    best = max(r["tokens_per_s"] for r in runs)  # (the round least slowed by other load)
    peak = max((r["peak_mem_gib_rank0"] for r in runs
                if r.get("peak_mem_gib_rank0") is not None), default=None)
    return {**row, **summarize(records, a.warmup, a.nproc), "best_round_tokens_per_s": best,
            "peak_mem_gib_rank0": peak}


def gpus_visible() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def table(rows: list[dict]) -> str:
    """The rows as markdown: tokens/s as median (min-max over the timed steps)."""
    fsdp = next((r["tokens_per_s"] for r in rows if r["layout"] == "fsdp"
                 and "tokens_per_s" in r), None)
    best_fsdp = next((r["best_round_tokens_per_s"] for r in rows if r["layout"] == "fsdp"
                      and "tokens_per_s" in r), None)
    lines = ["| layout | ranks | tokens/s, all ranks: median (min-max) | tokens/s per rank "
             "| vs fsdp | rounds' medians | best round vs fsdp's "
             "| peak memory, rank 0 (GiB) |", "|---|---:|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        if "tokens_per_s" not in r:
            lines.append(f"| {r['name']} | {r['nproc']} | failed: {r.get('error', r['rc'])} "
                         "| | | | | |")
            continue
        ratio = f"{r['tokens_per_s'] / fsdp:.2f}x" if fsdp else "-"
        best = r["best_round_tokens_per_s"]
        best_ratio = f"{best / best_fsdp:.2f}x" if best_fsdp else "-"
        medians = ", ".join(f"{run['tokens_per_s']:,.0f}" for run in r["rounds"])
        mem = r["peak_mem_gib_rank0"]
        lines.append(f"| {r['name']} | {r['nproc']} | {r['tokens_per_s']:,.0f} "
                     f"({r['tokens_per_s_min']:,.0f}-{r['tokens_per_s_max']:,.0f}) "
                     f"| {r['tokens_per_s_per_rank']:,.0f} | {ratio} | {medians} "
                     f"| {best_ratio} | {'-' if mem is None else f'{mem:.2f}'} |")
    return "\n".join(lines)


def machine(device: str) -> dict:
    """What the numbers were measured on: the device, torch, the load around the runs."""
    import platform

    import torch

    if device == "cuda":
        name = torch.cuda.get_device_name(0)
    else:
        models = [line.split(":", 1)[1].strip() for line in
                  Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")] if Path("/proc/cpuinfo").is_file() else []
        name = f"{models[0] if models else platform.processor()}, {os.cpu_count()} cores"
    return {"device": name, "torch": torch.__version__, "python": platform.python_version()}


def dry_run(a, args) -> int:
    """Each layout's run checked by ``lmforge train --dry-run --world-size N`` (the config
    resolved for N processes, the model built on meta, its memory estimated): 0 if all
    pass. Needs no GPU, so an 8-GPU row can be checked anywhere."""
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        corpus, tokenizer = write_corpus(Path(tmp), 20000)
        shared = train_overrides(a, args, corpus, tokenizer)
        for layout in a.layouts:
            proc = subprocess.run(
                [sys.executable, "-m", "lmforge.cli", "train", "--dry-run", "--world-size",
                 str(a.nproc), *shared, *layout_overrides(layout, a.nproc),
                 f"train.output_dir={tmp}/{layout}"],
                capture_output=True, text=True, env=train_env(a.device), timeout=a.timeout_s)
            memory = [line for line in proc.stdout.splitlines() if line.startswith("memory:")]
            print(f"{layout}: dry run exit {proc.returncode}; "
                  f"{memory[0] if memory else (proc.stdout + proc.stderr)[-2000:]}", flush=True)
            failed += proc.returncode != 0
    return 1 if failed else 0


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.dry_run:
        args = moe_bench.model_args(a.preset, shape_flags(a), a.seq_len)
        return dry_run(a, args)
    if a.device == "cuda" and gpus_visible() < a.nproc:
        print(f"skipped: ep={a.nproc} needs {a.nproc} GPUs, {gpus_visible()} visible")
        return 0
    args = moe_bench.model_args(a.preset, shape_flags(a), a.seq_len)
    if not moe_bench.is_moe(args):
        raise SystemExit(f"--preset {a.preset}: not a mixture of experts")
    if args.n_experts % a.nproc:
        raise SystemExit(f"{args.n_experts} experts do not split over --nproc {a.nproc}")
    print(moe_bench.describe(args), f"| seq {a.seq_len}, micro-batch {a.batch} per rank, "
          f"{a.nproc} ranks on {a.device}", flush=True)
    info = {**machine(a.device), "load_before": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(a.keep or tmp)
        root.mkdir(parents=True, exist_ok=True)
        tokens = (a.warmup + a.steps + 2) * a.batch * a.nproc * (a.seq_len + 1) * 2
        corpus, tokenizer = write_corpus(root, tokens)
        shared = train_overrides(a, args, corpus, tokenizer)
        records = {layout: [] for layout in a.layouts}
        rounds = {layout: [] for layout in a.layouts}
        for n in range(a.rounds):  # (alternated: a load that comes and goes hits both)
            for layout in a.layouts:
                out = root / f"{layout}-{n}"
                rc, tail, seconds = launch(out, shared + layout_overrides(layout, a.nproc), a)
                run = {"round": n, "rc": rc, "seconds": round(seconds, 1)}
                if rc == 0:
                    logged = [json.loads(line) for line in
                              (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
                    records[layout] += logged
                    run.update(summarize(logged, a.warmup, a.nproc))
                else:
                    print(tail, file=sys.stderr)
                print(json.dumps({"layout": layout, **run}), flush=True)
                rounds[layout].append(run)
        rows = [row_of(layout, a, rounds[layout], records[layout]) for layout in a.layouts]
    info["load_after"] = os.getloadavg()
    print(table(rows))
    print(f"{info['device']}, torch {info['torch']}; load average (1, 5, 15 min) "
          f"{'/'.join(f'{v:.1f}' for v in info['load_before'])} before, "
          f"{'/'.join(f'{v:.1f}' for v in info['load_after'])} after")
    if a.json:
        Path(a.json).write_text(json.dumps({"model": moe_bench.describe(args),
                                            "argv": sys.argv[1:], **info, "rows": rows},
                                           indent=1))
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
