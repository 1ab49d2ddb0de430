"""``lmforge bench-eval``: lm-evaluation-harness tasks on a model directory (+ adapter),
scored by lmforge's own model (``eval/harness.py``), offline."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from lmforge import fsio
from lmforge.cli.common import DEVICES, load_scored_model
from lmforge.config import resolve_device
from lmforge.data.tokenizer import load_tokenizer
from lmforge.eval.harness import check_tasks, headline_scores, offline, run_harness
from lmforge.perf.records import HARNESS_DIR, METRICS_FILE


def add_parser(sub) -> None:
    p = sub.add_parser("bench-eval", help="lm-evaluation-harness benchmarks of a model",
                       description="Score a Hugging Face model directory (optionally with a "
                       "PEFT adapter) on lm-evaluation-harness tasks, with lmforge's own "
                       "model answering the harness (pip install lm-eval). Offline: a task's "
                       "data must be on this machine (its YAML's data_files; --include-path "
                       "for task folders of your own). Prints the results as JSON.")
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--adapter", default=None, help="PEFT adapter directory (optional)")
    p.add_argument("--tasks", required=True,
                   help="comma-separated task names (lm-eval's, or from --include-path)")
    p.add_argument("--include-path", default=None, metavar="DIR",
                   help="a folder of task YAML files to add to lm-eval's. It is code: "
                   "a !function in a YAML imports and runs the Python file beside it "
                   "(docs/security.md); give only a folder you would execute")
    p.add_argument("--limit", type=float, default=None,
                   help="score the first N documents of each task (a fraction if < 1)")
    p.add_argument("--num-fewshot", type=int, default=None,
                   help="examples in each prompt (default: the task's)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per forward pass")
    p.add_argument("--device", default="auto", choices=DEVICES,
                   help="where to run (auto: a GPU when there is one)")
    p.add_argument("--output", default=None,
                   help="also write the JSON result to this file (default: for a run's "
                   "model, RUN/hf, RUN/harness/<tasks>.json, which lmforge report reads; "
                   "else stdout only)")
    p.set_defaults(func=_bench_eval)


def _bench_eval(args) -> int:
    offline()  # first: the hub's and datasets' switches are read when they are imported
    if args.batch_size <= 0 or (args.limit is not None and args.limit <= 0):
        raise ValueError("--batch-size and --limit must be > 0")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise ValueError("--num-fewshot must be >= 0")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    output = Path(args.output) if args.output else run_output(args.adapter or args.model, tasks)
    if output is not None:
        fsio.check_apart(output, "--output", [("--model", args.model),
                                              ("--adapter", args.adapter),
                                              ("--include-path", args.include_path)])
        fsio.check_writable(output, "--output")
    if args.include_path and not Path(args.include_path).is_dir():
        raise ValueError(f"--include-path: {args.include_path} is not a directory")
    manager = check_tasks(tasks, args.include_path)  # the data, before the model loads
    device = resolve_device(args.device, "--device")
    model = load_scored_model(args.model, args.adapter, device)
    results = run_harness(model, load_tokenizer(args.model), device, tasks,
                          args.include_path, args.limit, args.num_fewshot, args.batch_size,
                          manager=manager)
    result = {"model": str(args.model), "adapter": args.adapter, "tasks": tasks,
              "limit": args.limit, "num_fewshot": args.num_fewshot,
              "scores": headline_scores(results), **results}
    text = json.dumps(result, indent=2, default=str)
    print(text)
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        fsio.atomic_write_bytes(output, (text + "\n").encode())
        print(f"written to {output}", file=sys.stderr)
    return 0


def run_output(model_dir: str, tasks: list[str]) -> Path | None:
    """Where a run's model (``RUN/hf``, or its adapter, ``RUN/adapter``) records its
    benchmarks when no --output is given:
    ``RUN/harness/<tasks>.json``, which ``lmforge report RUN`` reads; None elsewhere."""
    run = Path(model_dir).resolve().parent
    if not (run / METRICS_FILE).is_file():
        return None
    return run / HARNESS_DIR / f"{'+'.join(tasks)}.json"
