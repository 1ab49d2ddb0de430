"""Preprocessing throughput and peak memory, against the tokenizer's raw speed.

    PYTHONPATH=src python bench/preprocess.py [--mb 20] [--workers 1 2] [--grow 10]
                                              [--repeat 3]

Corpus: the Python standard library's .py files as JSON Lines documents (real text, no
download), repeated up to ``--mb`` MB. One tokenizer (byte-level BPE, 8,192 ids, trained
on a slice of the corpus) is used throughout. Measured, each in a fresh process:

* raw, 1 thread: ``tokenizer.encode`` on every document, already in memory, in one
  process with TOKENIZERS_PARALLELISM=false (the ceiling for one core);
* raw, batched: ``tokenizer.encode_batch`` in one process (the tokenizer's own threads);
* ``lmforge preprocess --workers N`` end to end (read, parse, tokenize, write .bin/.idx);
* peak memory of ``preprocess`` on the corpus and on the same corpus written ``--grow``
  times: ru_maxrss of the main process and of the largest process (a worker), and the
  peak sum of RSS over the process tree (sampled every 20 ms from /proc).

Wall-clock figures need an otherwise idle machine; the CPU seconds (user + sys of every
process) and tokens per CPU second are robust to other load.

Prints a Markdown table (paste into docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = str(ROOT / "src")


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def build_corpus(path: Path, megabytes: float, repeat: int = 1) -> int:
    """The first ``megabytes`` of stdlib files as JSON Lines, written ``repeat`` times
    (so a larger corpus has the same documents, only more of them)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(f for f in stdlib.rglob("*.py") if "site-packages" not in f.parts)
    lines, size = [], 0
    for f in files:
        if size >= megabytes * 1e6:
            break
        lines.append(json.dumps({"text": f.read_text(encoding="utf-8", errors="replace")})
                     + "\n")
        size += len(lines[-1].encode())
    with open(path, "w") as out:
        for _ in range(repeat):
            out.writelines(lines)
    return size * repeat


def train_tokenizer(corpus: Path, out: Path) -> None:
    sys.path.insert(0, SRC)
    from lmforge.data.tokenizer import train_bpe

    texts = []
    with open(corpus) as f:
        for i, line in zip(range(300), f):
            texts.append(json.loads(line)["text"])
    train_bpe(texts, 8192).save(out)


RAW = """
import json, os, sys, time
sys.path.insert(0, {src!r})
from lmforge.data.tokenizer import load_tokenizer
tok = load_tokenizer({tok!r})
texts = [json.loads(l)["text"] for l in open({corpus!r})]
t, c = time.perf_counter(), time.process_time()
if {batched}:
    n = sum(len(x) for i in range(0, len(texts), 256) for x in tok.encode_batch(texts[i:i+256]))
else:
    n = sum(len(tok.encode(x)) for x in texts)
print(json.dumps({{"tokens": n, "seconds": time.perf_counter() - t,
                  "cpu_s": time.process_time() - c}}))
"""

WRAPPED = """
import json, resource, sys
sys.path.insert(0, {src!r})
from lmforge.cli import main
rc = main(["preprocess", *sys.argv[1:]])
me, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
print("RUSAGE " + json.dumps({{"self": me.ru_maxrss, "children": kids.ru_maxrss,
    "cpu_s": me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime}}))
sys.exit(rc)
"""


def tree_rss_kib(root_pid: int) -> int:
    """Sum of VmRSS over ``root_pid`` and its descendants, from /proc."""
    parents = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parents[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    tree, grew = {root_pid}, True
    while grew:
        new = {p for p, pp in parents.items() if pp in tree} - tree
        tree |= new
        grew = bool(new)
    total = 0
    for pid in tree:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
        except OSError:
            pass
    return total


def run_preprocess(corpus: Path, tok: Path, prefix: Path, workers: int) -> dict:
    cmd = [sys.executable, "-c", WRAPPED.format(src=SRC), "--input", str(corpus),
           "--output-prefix", str(prefix), "--tokenizer", str(tok), "--append-eod",
           "--workers", str(workers), "--no-progress"]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = [0]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], tree_rss_kib(proc.pid))
            time.sleep(0.02)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    out, err = proc.communicate()
    seconds = time.perf_counter() - start
    done.set()
    thread.join()
    if proc.returncode:
        raise SystemExit(f"preprocess failed:\n{err}")
    usage = json.loads(out.split("RUSAGE ", 1)[1])
    tokens = int(out.split(" tokens in ")[0].rsplit(", ", 1)[1].replace(",", ""))
    return {"seconds": seconds, "tokens": tokens, "tree_peak_mib": peak[0] / 1024,
            "cpu_s": usage["cpu_s"], "main_rss_mib": usage["self"] / 1024,
            "max_rss_mib": max(usage["self"], usage["children"]) / 1024}


def raw_speed(corpus: Path, tok: Path, batched: bool) -> dict:
    env = dict(os.environ)
    if not batched:
        env["TOKENIZERS_PARALLELISM"] = "false"
    code = RAW.format(src=SRC, tok=str(tok), corpus=str(corpus), batched=batched)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=20.0, help="corpus size for throughput")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--grow", type=int, default=10, help="factor for the memory check")
    p.add_argument("--repeat", type=int, default=3, help="rounds; the fastest counts")
    p.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    args = p.parse_args()
    scratch = Path(args.dir or tempfile.mkdtemp(prefix="lmforge-bench-"))
    scratch.mkdir(parents=True, exist_ok=True)
    corpus = scratch / "corpus.jsonl"
    size = build_corpus(corpus, args.mb)
    tok = scratch / "tokenizer"
    train_tokenizer(corpus, tok)

    # Best of --repeat rounds, the variants interleaved, so other load on the machine
    # hurts each of them alike and the least disturbed round counts.
    best: dict = {}
    for _ in range(args.repeat):
        trial = {"single": raw_speed(corpus, tok, batched=False),
                 "batched": raw_speed(corpus, tok, batched=True)}
        for n in args.workers:
            trial[n] = run_preprocess(corpus, tok, scratch / f"out-w{n}", n)
        for key, r in trial.items():
            if key not in best or r["seconds"] < best[key]["seconds"]:
                best[key] = r
    single, runs = best["single"], {n: best[n] for n in args.workers}
    rows = [("raw `encode`, 1 process, 1 thread", single, None),
            ("raw `encode_batch`, 1 process, tokenizer threads", best["batched"], None)]
    rows += [(f"`lmforge preprocess --workers {n}`", runs[n], runs[n]) for n in args.workers]

    big = scratch / "corpus-big.jsonl"
    big_size = build_corpus(big, args.mb, repeat=args.grow)
    w = max(args.workers)
    grown = run_preprocess(big, tok, scratch / "out-big", w)

    base = single["tokens"] / single["seconds"]
    load = os.getloadavg()
    print(f"\nDevice: {cpu_name()}, {os.cpu_count()} cores; Python {platform.python_version()}"
          f"; load average at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}")
    print(f"Corpus: {size / 1e6:.1f} MB of JSON Lines (stdlib .py files), "
          f"{single['tokens']:,} tokens; BPE vocab 8192; best of {args.repeat} rounds\n")
    print("| what | tokens/s (wall) | MB/s | vs raw 1 thread | CPU s | tokens per CPU s "
          "| peak RSS, largest process | peak RSS, process tree |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, r, mem in rows:
        speed = r["tokens"] / r["seconds"]
        extra = (f"{mem['max_rss_mib']:.0f} MiB | {mem['tree_peak_mib']:.0f} MiB" if mem
                 else "- | -")
        print(f"| {name} | {speed:,.0f} | {size / 1e6 / r['seconds']:.2f} | "
              f"{speed / base:.2f}x | {r['cpu_s']:.1f} | {r['tokens'] / r['cpu_s']:,.0f} | "
              f"{extra} |")
    print(f"\nPeak memory as the input grows {args.grow:g}x (--workers {w}):\n")
    print("| input | tokens | seconds | peak RSS, main process | peak RSS, largest process "
          "| peak RSS, process tree |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, r in ((f"{size / 1e6:.0f} MB", runs[w]), (f"{big_size / 1e6:.0f} MB", grown)):
        print(f"| {label} | {r['tokens']:,} | {r['seconds']:.1f} | {r['main_rss_mib']:.0f} MiB"
              f" | {r['max_rss_mib']:.0f} MiB | {r['tree_peak_mib']:.0f} MiB |")

if __name__ == "__main__":
    main()
