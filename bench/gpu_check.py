"""Every training path on one device, a few steps each, in one command; then the three
side-by-side benches against transformers. Made for a short GPU slot:

    make gpu-check                                    # = python bench/gpu_check.py --out runs/gpu-check
    python bench/gpu_check.py --device cpu --tiny --out /tmp/check   # the same list, tiny shapes (CI)

Each path is a real ``lmforge train`` (or generation) in its own process, started from
the same random base model on data prepared here (a tokenizer, a preprocessed corpus and
an SFT file, all from Python's standard library: nothing is downloaded). Per path it
records: ok / the error's first line, the loss at the first and last step, tokens/s and
MFU (median over the steps after the first), peak allocated and reserved memory, and
``lmforge estimate``'s predicted peak for the same config. A failing path never stops the
others. Results: ``OUT/gpu_check.json`` and ``OUT/gpu_check.md`` (also printed), written
again after every path and bench, so a call cut off at its time limit keeps what it
measured; ``--budget-s S`` starts nothing after S seconds (the rest are rows marked
skipped), ``--only WORD`` runs the paths whose name holds a word. A GPU-only path (flex)
is a skipped row on the CPU.

The benches are ``bench/train_step.py`` runs (each side in its own process): llama3.2-1b
full bf16 at seq 2048, llama2-7b QLoRA at batch 4 x 2048 (the reference needs
bitsandbytes), llama2-7b low-memory full fine-tune at batch 1 x 2048. ``--tiny`` runs them
on the debug preset. Then (not with ``--tiny``; ``--only loss`` picks them with the loss
paths) bench/loss_heads.py's rows: the 1B's plain, chunked and fused loss at micro-batch 1
and 8, lmforge alone.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
# Children import this checkout's lmforge, installed or not (a GPU image has no pip index).
CHILD_ENV = {**os.environ, "PYTHONUNBUFFERED": "1",
             "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"),
                                                         os.environ.get("PYTHONPATH")]))}


@dataclass
class Shapes:
    """Model and batch sizes of one check: ``full`` for a GPU, ``tiny`` for CI's CPU."""
    model: dict  # LlamaArgs fields of the base model (vocab: the tokenizer's)
    tokenizer_vocab: int
    corpus_chars: int
    seq_len: int
    micro_batch: int
    steps: int
    loss_chunk_tokens: int
    generate_tokens: int
    benches: list  # bench/train_step.py argument lists
    timeout_s: int


FULL = Shapes(
    # llama3.2-1b's block shapes, 8 of its 16 layers: big enough for an honest MFU, small
    # enough that a dozen short runs fit a 10-minute slot.
    model=dict(dim=2048, n_layers=8, n_heads=32, n_kv_heads=8, ffn_dim=8192,
               max_seq_len=8192, rope_theta=500000.0, tie_embeddings=True),
    tokenizer_vocab=32000, corpus_chars=4_000_000, seq_len=2048, micro_batch=2, steps=10,
    loss_chunk_tokens=1024, generate_tokens=256,
    benches=[
        ["--preset", "llama3.2-1b", "--seq-len", "2048", "--batch", "1", "--compile"],
        ["--preset", "llama2-7b", "--method", "qlora", "--seq-len", "2048", "--batch", "4",
         "--activation-checkpointing"],
        ["--preset", "llama2-7b", "--seq-len", "2048", "--batch", "1", "--low-memory",
         "--activation-checkpointing", "--loss-chunk-tokens", "1024"],
    ],
    timeout_s=300)

TINY = Shapes(
    model=dict(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=344, max_seq_len=512,
               tie_embeddings=False),
    tokenizer_vocab=600, corpus_chars=300_000, seq_len=64, micro_batch=2, steps=3,
    loss_chunk_tokens=32, generate_tokens=16,
    benches=[
        ["--preset", "debug", "--seq-len", "64", "--batch", "2"],
        ["--preset", "debug", "--method", "qlora", "--seq-len", "64", "--batch", "2"],
        ["--preset", "debug", "--seq-len", "64", "--batch", "1", "--low-memory",
         "--loss-chunk-tokens", "32"],
    ],
    timeout_s=300)
FLEX_CPU = "FlexAttention has no backward on the CPU"
PROFILE = "profile: compiled, last 3 steps (torch.profiler)"
AUTO_PATH = "data.micro_batch_size=auto"
BENCH_STEPS = {"full": ["--steps", "6", "--warmup", "2"], "tiny": ["--steps", "1", "--warmup", "1"]}


@dataclass
class PathSpec:
    name: str
    overrides: list = field(default_factory=list)
    kind: str = "train"  # train | torchrun | generate | resume
    gpu_only: str = ""  # why the path cannot run on the CPU (a skipped row there)


def path_specs(shapes: Shapes) -> list[PathSpec]:
    low_memory = ["train.param_dtype=bf16", "optim.name=adamw_bf16", "optim.in_backward=true",
                  "optim.grad_clip=0"]
    lora = ["lora.enabled=true", "lora.rank=16", "lora.alpha=32", "lora.targets=all-linear"]
    long_sequence = [f"data.seq_len={4 * shapes.seq_len}", "data.micro_batch_size=1",
                     "data.document_mask=true", "train.activation_checkpointing=full"]
    return [
        PathSpec("full, eager"),
        PathSpec("full, train.compile=true", ["train.compile=true"]),
        PathSpec("activation checkpointing full", ["train.activation_checkpointing=full"]),
        # its peak memory against the row above's: what offloading the block inputs saves
        PathSpec("activation checkpointing full + activation offload",
                 ["train.activation_checkpointing=full", "train.activation_offload=true"]),
        PathSpec("activation checkpointing selective",
                 ["train.activation_checkpointing=selective"]),
        PathSpec("chunked loss", [f"train.loss_chunk_tokens={shapes.loss_chunk_tokens}"]),
        # against the two rows above: the fused linear + cross-entropy (models/fused_loss.py)
        PathSpec("fused loss", ["train.fused_loss=true",
                                 f"train.loss_chunk_tokens={shapes.loss_chunk_tokens}"]),
        PathSpec("low memory (bf16 weights, adamw_bf16, in backward)", low_memory),
        # against "full, eager" (bf16 on a GPU): fp16's speed, memory and loss
        PathSpec("fp16 autocast, dynamic loss scaling", ["train.dtype=fp16"]),
        PathSpec("FSDP2, one process (torchrun, dp_shard=1)", ["parallel.dp_shard=1"],
                 kind="torchrun"),
        PathSpec("LoRA", lora),
        PathSpec("QLoRA NF4", lora + ["lora.quantize=nf4"]),
        PathSpec("LoRA, int8 base", lora + ["lora.quantize=int8"]),
        PathSpec("packed SFT, document masks", ["data.kind=sft", "data.pack=true",
                                                "data.template=plain"]),
        # against the row above: FlexAttention's block masks for the same batches
        PathSpec("packed SFT, document masks, flex", [
            "data.kind=sft", "data.pack=true", "data.template=plain", "model.attention=flex"],
            gpu_only=FLEX_CPU),
        # four times the sequence, one row, documents packed back to back (flex, then sdpa
        # with its dense mask): memory and speed as the sequence grows
        PathSpec("long sequence, document masks, flex", long_sequence + ["model.attention=flex"],
                 gpu_only=FLEX_CPU),
        PathSpec("long sequence, document masks, sdpa", long_sequence),
        # the batched decoder (models/generate.py), greedy; compiled with CUDA graphs on a GPU
        PathSpec("generation, batch 1", ["--batch", "1"], kind="generate"),
        PathSpec("generation, batch 32", ["--batch", "32"], kind="generate"),
        PathSpec("checkpoint save, then resume", kind="resume"),
        # torch.profiler over the compiled path's last 3 steps: where the time goes (the
        # kernels with the most time, matmul / attention / elementwise / idle shares)
        PathSpec(PROFILE, ["train.compile=true"], kind="profile"),
        # the largest micro-batch the estimate fits in the GPU less 5%: its measured peak
        # against the GPU's memory (perf/auto_batch.py; the CPU refuses auto)
        PathSpec(AUTO_PATH, ["data.micro_batch_size=auto"],
                 gpu_only="auto sizes to a GPU's memory (refused on the CPU)"),
    ]


# ------------------------------------------------------------------------- preparation

def prepare(out: Path, shapes: Shapes) -> dict:
    """Tokenizer, preprocessed corpus, SFT file and random base model under ``out``."""
    import torch

    from lmforge.data.preprocess import preprocess
    from lmforge.data.text import stdlib_files
    from lmforge.data.tokenizer import read_text, train_bpe
    from lmforge.models.hf import save_hf_model
    from lmforge.models.llama import LlamaArgs, build_llama, materialize

    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    texts = [read_text(f) for f in stdlib_files(shapes.corpus_chars)]
    tokenizer = train_bpe(texts, shapes.tokenizer_vocab)
    tokenizer.save(out / "tokenizer")
    with open(data / "corpus.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    preprocess([data / "corpus.jsonl"], data / "corpus", out / "tokenizer", append_eod=True)
    with open(data / "chat.jsonl", "w") as f:  # code -> its continuation, as chat turns
        n = shapes.seq_len  # characters per part: prompt and answer fit one row together
        for t in texts:
            for start in range(0, len(t) - 2 * n, 6 * n):
                f.write(json.dumps({"prompt": "Continue:\n" + t[start:start + n // 2],
                                    "response": t[start + n // 2:start + n]}) + "\n")
    args = LlamaArgs(**shapes.model, vocab_size=tokenizer.vocab_size)
    torch.manual_seed(0)
    model = materialize(build_llama(args), "cpu")
    save_hf_model(model, out / "base", tokenizer=tokenizer,
                  dtype=torch.bfloat16 if shapes is FULL else None)
    return {"parameters": sum(p.numel() for p in model.parameters()),
            "vocab": tokenizer.vocab_size}


def common_overrides(out: Path, shapes: Shapes, device: str) -> list[str]:
    return [f"model.init_from={out / 'base'}", "model.preset=null", "data.kind=pretrain",
            f"data.path={out / 'data' / 'corpus'}", f"data.seq_len={shapes.seq_len}",
            f"data.micro_batch_size={shapes.micro_batch}", f"train.max_steps={shapes.steps}",
            "train.log_every=1", "train.save=false", "train.sample_tokens=1",
            f"train.device={device}", "optim.warmup_steps=0", "optim.lr=1e-4",
            "data.eval_fraction=0", "train.progress_bar=false"]


def with_sft_data(overrides: list[str], out: Path) -> list[str]:
    """``data.kind=sft`` in a spec points data.path at the SFT file."""
    if "data.kind=sft" not in overrides:
        return overrides
    return [o for o in overrides if not o.startswith("data.path=")] + [
        f"data.path={out / 'data' / 'chat.jsonl'}"]


# ------------------------------------------------------------------------------ runs

def run_path(spec: PathSpec, out: Path, shapes: Shapes, device: str) -> dict:
    result = {"path": spec.name, "ok": False}
    if spec.gpu_only and device == "cpu":
        return {**result, "ok": None, "skipped": spec.gpu_only, "seconds": 0.0}
    start = time.perf_counter()
    try:
        if spec.kind == "generate":
            result.update(run_generate(out, shapes, device, spec.overrides))
        else:
            overrides = with_sft_data(common_overrides(out, shapes, device) + spec.overrides,
                                      out)
            result.update(estimate_peak(overrides, device))
            run_dir = out / "runs" / slug(spec.name)
            shutil.rmtree(run_dir, ignore_errors=True)
            if spec.kind == "resume":
                result.update(run_resume(overrides, run_dir, shapes))
            elif spec.kind == "profile":
                result.update(run_profile(overrides, run_dir, shapes, device))
            else:
                train(overrides, run_dir, shapes.timeout_s, torchrun=spec.kind == "torchrun")
                result.update(read_run(run_dir))
                if spec.name == AUTO_PATH:  # the number it picked (summary.json records it)
                    summary = json.loads((run_dir / "summary.json").read_text())
                    result["micro_batch"] = summary["micro_batch_size"]
        result["ok"] = "error" not in result
    except Exception as e:  # one path's failure is a row of the table, not the end
        result["error"] = first_line(e)
    result["seconds"] = round(time.perf_counter() - start, 1)
    return result


def train(overrides: list[str], run_dir: Path, timeout_s: int, torchrun: bool = False) -> None:
    entry = ["-m", "lmforge.cli", "train", *overrides, f"train.output_dir={run_dir}"]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node=1"] if torchrun else [sys.executable]
    proc = subprocess.run(launcher + entry, capture_output=True, text=True, timeout=timeout_s,
                          env=CHILD_ENV)
    if proc.returncode != 0:
        raise RuntimeError(error_line(proc.stderr) or f"exit status {proc.returncode}")


def read_run(run_dir: Path) -> dict:
    records = [json.loads(line) for line in
               (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if not records:
        raise RuntimeError(f"{run_dir}/metrics.jsonl: no step was logged")
    timed = records[1:] or records  # the first step carries compilation and warm-up
    mfu = [r["mfu"] for r in timed if r.get("mfu") is not None]
    reserved = [r["peak_reserved_gib"] for r in records if r.get("peak_reserved_gib") is not None]
    return {"first_loss": records[0]["loss"], "last_loss": records[-1]["loss"],
            "steps": len(records),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
            "mfu": statistics.median(mfu) if mfu else None,
            "peak_allocated_gib": max(r.get("peak_mem_gib") or 0.0 for r in records),
            "peak_reserved_gib": max(reserved) if reserved else None}  # None on the CPU


def run_resume(overrides: list[str], run_dir: Path, shapes: Shapes) -> dict:
    """Half the steps, a checkpoint, a new process resuming to the end; its losses must be
    those of one uninterrupted run."""
    half = max(1, shapes.steps // 2)
    train(overrides + [f"train.stop_at_step={half}", f"train.checkpoint_every={half}"],
          run_dir, shapes.timeout_s)
    train(overrides + ["train.resume=auto"], run_dir, shapes.timeout_s)
    straight = run_dir.with_name(run_dir.name + "-straight")
    shutil.rmtree(straight, ignore_errors=True)
    train(overrides, straight, shapes.timeout_s)
    resumed, reference = (read_losses(d) for d in (run_dir, straight))
    if len(resumed) != len(reference):
        raise RuntimeError(f"resumed run logged {len(resumed)} steps, the straight one "
                           f"{len(reference)}")
    diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(resumed, reference))
    out = read_run(run_dir) | {"resume_max_rel_diff": diff}
    if diff > 1e-3:
        out["error"] = f"resumed losses differ from the straight run's (max rel diff {diff:.2e})"
    return out


def run_profile(overrides: list[str], run_dir: Path, shapes: Shapes, device: str) -> dict:
    """The run under bench/profile_step.py (its own process): the row's figures as any
    path's, and the profile the report's "where the time goes" table shows."""
    target = run_dir / "profile.json"
    run_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "profile_step.py"), "--json",
                           str(target), "--device", device, "--", *overrides,
                           f"train.output_dir={run_dir / 'run'}"], capture_output=True,
                          text=True, timeout=shapes.timeout_s, env=CHILD_ENV)
    if proc.returncode != 0 or not target.is_file():
        raise RuntimeError(error_line(proc.stderr) or f"exit status {proc.returncode}")
    return read_run(run_dir / "run") | {"profile": json.loads(target.read_text())}


def profile_lines(paths: list) -> list:
    """The profile path's tables: the kernels with the most time, and the shares."""
    row = next((r for r in paths if r.get("profile")), None)
    if row is None:
        return []
    p = row["profile"]
    what = "kernel" if p["device"] == "cuda" else "operator (self CPU time)"
    shares = ", ".join(f"{k} {v:.1%}" for k, v in p["shares"].items())
    lines = ["", f"Where the time goes ({row['path']}, {p['window_ms']:.1f} ms recorded): "
             f"{shares}.", "", f"| {what} | kind | ms | share of {what.split(' ')[0]} time |",
             "|---|---|---:|---:|"]
    for k in p["top"]:
        name = k["name"].replace("|", "/")
        lines.append(f"| `{name[:100]}` | {k['kind']} | {k['ms']:.2f} | {k['share']:.1%} |")
    return lines


def read_losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in
            (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def run_generate(out: Path, shapes: Shapes, device: str, extra: list) -> dict:
    cmd = [sys.executable, __file__, "--child-generate", str(out / "base"), "--device", device,
           "--tokens", str(shapes.generate_tokens), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=shapes.timeout_s,
                          env=CHILD_ENV)
    if proc.returncode != 0:
        raise RuntimeError(error_line(proc.stderr) or f"exit status {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def child_generate(model_dir: str, device: str, tokens: int, batch: int) -> dict:
    """Greedy decoding of ``tokens`` new tokens for each of ``batch`` prompts, after one
    warm-up; the decode step compiled (CUDA graphs) on a GPU. tokens/s: the batch's."""
    import torch

    from lmforge.data.tokenizer import load_tokenizer
    from lmforge.models.generate import generate
    from lmforge.models.hf import load_hf_model
    from lmforge.train import metrics as M

    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else None
    model = load_hf_model(model_dir, device=dev, dtype=dtype)
    prompt = load_tokenizer(model_dir).encode("def main():\n    ")
    prompts = [prompt[:len(prompt) - i % 3] for i in range(batch)]  # lengths differ a little
    compile = dev.type == "cuda"
    generate(model, prompts, tokens, compile=compile)  # (compiles: same shapes as below)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    start = time.perf_counter()
    new = sum(len(c.ids) for c in generate(model, prompts, tokens, compile=compile))
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    seconds = time.perf_counter() - start
    memory = M.memory_metrics(dev)
    return {"tokens_per_s": new / seconds, "steps": new // batch, "compiled": compile,
            "peak_allocated_gib": memory["peak_mem_gib"],
            "peak_reserved_gib": memory["peak_reserved_gib"]}


def estimate_peak(overrides: list[str], device: str) -> dict:
    """``lmforge estimate``'s peak allocated memory for the same config."""
    try:
        from lmforge.config import load_config
        from lmforge.perf.auto_batch import size_micro_batch
        from lmforge.perf.estimate import estimate_memory
        from lmforge.perf.estimate_setup import setup_from_config

        cfg, _ = size_micro_batch(load_config(None, overrides), 1)  # (auto: as the run)
        est = estimate_memory(setup_from_config(cfg, device=device))
        return {"estimate_gib": est.peak_bytes / 2**30}
    except Exception as e:  # an estimate that fails is reported beside a run that may not
        return {"estimate_error": first_line(e)}


def run_bench(argv: list[str], out: Path, tiny: bool, device: str, timeout_s: int) -> dict:
    target = out / "benches" / f"{slug(' '.join(argv))}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(ROOT / "bench" / "train_step.py"), *argv,
           *BENCH_STEPS["tiny" if tiny else "full"], "--device", device, "--json", str(target)]
    row = {"bench": " ".join(argv)}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                              env=CHILD_ENV)
        if not target.is_file():
            raise RuntimeError(error_line(proc.stderr) or f"exit status {proc.returncode}")
        sides = {r["side"]: r for r in json.loads(target.read_text())["results"]}
        row.update(sides)
        ours, ref = sides.get("lmforge", {}), sides.get("reference", {})
        if "tokens_per_s" in ours and "tokens_per_s" in ref:
            row["speed_ratio"] = ours["tokens_per_s"] / ref["tokens_per_s"]
            row["memory_ratio"] = ours["peak_mem_gib"] / ref["peak_mem_gib"]
        row["ok"] = "error" not in ours
    except Exception as e:
        row.update(ok=False, error=first_line(e))
    return row


# --------------------------------------------------------------------------- reports

def markdown(report: dict) -> str:
    def num(value, fmt):
        return "" if value is None else format(value, fmt)

    lines = [f"Device: {report['device']}; torch {report['torch']}; base model "
             f"{report['base']['parameters']:,} parameters (vocab {report['base']['vocab']}), "
             f"seq {report['seq_len']} x micro-batch {report['micro_batch']}, "
             f"{report['steps']} steps; {report['seconds']:.0f} s in all."
             + (" On the CPU, peak allocated is the process's peak resident set." if
                report["device"].startswith("CPU") else ""), "",
             "| path | ok | loss first -> last | tokens/s | MFU | peak alloc GiB | "
             "peak reserved GiB | estimate GiB |", "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in report["paths"]:
        status = ("ok" if r["ok"] else f"skipped: {r['skipped']}" if r["ok"] is None
                  else f"**error**: {r.get('error', '')}")
        if r["ok"] and r.get("micro_batch"):
            status += f" (micro-batch {r['micro_batch']})"
        losses = (f"{r['first_loss']:.4f} -> {r['last_loss']:.4f}"
                  if r.get("first_loss") is not None else "")
        lines.append(f"| {r['path']} | {status} | {losses} | {num(r.get('tokens_per_s'), ',.0f')} "
                     f"| {num(r.get('mfu'), '.1%')} | {num(r.get('peak_allocated_gib'), '.2f')} "
                     f"| {num(r.get('peak_reserved_gib'), '.2f')} "
                     f"| {estimate_cell(r)} |")
    lines += profile_lines(report["paths"])
    lines += ["", "| bench (bench/train_step.py) | lmforge tokens/s | MFU | peak GiB | "
              "reference tokens/s | MFU | peak GiB | speed ratio |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for b in report["benches"]:
        cells = []
        for side in ("lmforge", "reference"):
            r = b.get(side, {})
            if "error" in r or not r:
                why = b.get("skipped") or r.get("error", b.get("error", "not run"))
                cells += [f"n/a ({why})", "", ""]
            else:
                cells += [f"{r['tokens_per_s']:,.0f}", num(r.get("mfu"), ".1%"),
                          num(r.get("peak_mem_gib"), ".2f")]
        lines.append(f"| `{b['bench']}` | " + " | ".join(cells) +
                     f" | {num(b.get('speed_ratio'), '.2f')} |")
    lines += loss_head_lines(report.get("loss_heads", []))
    return "\n".join(lines) + "\n"


def estimate_cell(row: dict) -> str:
    if row.get("estimate_gib") is not None:
        return f"{row['estimate_gib']:.2f}"
    return f"n/a ({row['estimate_error']})" if row.get("estimate_error") else ""


def device_name(device: str) -> str:
    import torch

    if device == "cuda":
        return torch.cuda.get_device_name(0)
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-")[:80]


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def error_line(stderr: str) -> str:
    """lmforge's one-line error, or the last line of a traceback."""
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    for line in lines:
        if line.startswith("lmforge: error:"):
            return line.removeprefix("lmforge: error:").strip()
    return lines[-1].strip() if lines else ""


# ---------------------------------------------------------------------------- driver

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/gpu-check",
                   help="working directory (data, base model, runs)")
    p.add_argument("--report-dir", default=None,
                   help="where gpu_check.json and gpu_check.md go (default: --out)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CI on the CPU)")
    p.add_argument("--only", nargs="+", metavar="WORD",
                   help="run only the paths whose name contains one of these words")
    p.add_argument("--no-benches", action="store_true", help="skip the side-by-side benches")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no path or bench after this many seconds from the start "
                   "(the rest are rows marked skipped; the report is written after each)")
    p.add_argument("--child-generate", help=argparse.SUPPRESS)
    p.add_argument("--tokens", type=int, default=64, help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child_generate:
        print(json.dumps(child_generate(args.child_generate, args.device, args.tokens,
                                        args.batch)))
        return 0
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible (use --device cpu --tiny on a CPU)",
              file=sys.stderr)
        return 2
    shapes = TINY if args.tiny else FULL
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    report = {"device": device_name(args.device), "torch": torch.__version__,
              "tiny": args.tiny, "seq_len": shapes.seq_len, "micro_batch": shapes.micro_batch,
              "steps": shapes.steps, "base": prepare(out, shapes), "paths": [], "benches": []}
    print(f"prepared in {time.perf_counter() - start:.0f} s: {report['base']}", flush=True)
    report_dir = Path(args.report_dir or out)

    def out_of_time() -> bool:
        return args.budget_s is not None and time.perf_counter() - start > args.budget_s

    for spec in path_specs(shapes):
        if args.only and not any(w.lower() in spec.name.lower() for w in args.only):
            continue
        result = (run_path(spec, out, shapes, args.device) if not out_of_time() else
                  {"path": spec.name, "ok": None, "skipped": "time budget (--budget-s)"})
        report["paths"].append(result)
        print(f"{spec.name}: {status(result)} ({result.get('seconds', 0)} s)", flush=True)
        write_report(report, report_dir, start)  # a call cut off keeps what it measured
    if not args.no_benches:
        for bench in shapes.benches:
            report["benches"].append(
                run_bench(bench, out, args.tiny, args.device, 3 * shapes.timeout_s)
                if not out_of_time() else
                {"bench": " ".join(bench), "ok": None, "skipped": "time budget (--budget-s)"})
            write_report(report, report_dir, start)
    if not args.no_benches and not args.tiny and wants_loss_heads(args.only):
        report["loss_heads"] = run_loss_heads(out, args.device, start, args.budget_s)
    print(write_report(report, report_dir, start))
    return 0 if all(r["ok"] is not False for r in report["paths"]) else 1


def wants_loss_heads(only) -> bool:
    return not only or any(w.lower() in "loss heads 1b" for w in only)


def run_loss_heads(out: Path, device: str, start: float, budget_s) -> list:
    """bench/loss_heads.py's 1B rows: plain, chunked and fused loss at micro-batch 1 and 8,
    seq 2048, compiled (lmforge alone); what is left of --budget-s bounds them."""
    target = out / "benches" / "loss-heads.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    left = None if budget_s is None else budget_s - (time.perf_counter() - start)
    if left is not None and left <= 0:
        return [{"loss": "all", "error": "skipped: time budget (--budget-s)"}]
    try:
        subprocess.run([sys.executable, str(ROOT / "bench" / "loss_heads.py"), "steps",
                        "--device", device, "--json", str(target)], capture_output=True,
                       text=True, timeout=left, env=CHILD_ENV)
    except subprocess.TimeoutExpired:
        pass  # (the rows written so far stay)
    return json.loads(target.read_text())["rows"] if target.is_file() else []


def loss_head_lines(rows: list) -> list:
    if not rows:
        return []
    lines = ["", "| loss (llama3.2-1b, seq 2048, compiled; bench/loss_heads.py) | micro-batch | "
             "tokens/s | MFU | peak GiB |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['loss']} | {r.get('micro_batch', '')} | n/a ({r['error']}) | | |")
            continue
        mfu = "" if r.get("mfu") is None else f"{r['mfu']:.1%}"
        lines.append(f"| {r['loss']} | {r['micro_batch']} | {r['tokens_per_s']:,.0f} | {mfu} "
                     f"| {r['peak_mem_gib']:.2f} |")
    return lines


def status(result: dict) -> str:
    if result["ok"] is None:
        return f"skipped: {result['skipped']}"
    return "ok" if result["ok"] else "ERROR " + result.get("error", "")


def write_report(report: dict, report_dir: Path, start: float) -> str:
    """gpu_check.json and gpu_check.md as they stand; returns the table."""
    report["seconds"] = time.perf_counter() - start
    report_dir.mkdir(parents=True, exist_ok=True)
    (report_dir / "gpu_check.json").write_text(json.dumps(report, indent=2))
    table = markdown(report)
    (report_dir / "gpu_check.md").write_text(table)
    return table


if __name__ == "__main__":
    sys.exit(main())
