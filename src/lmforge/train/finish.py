"""The end of a run: export (HF, and the adapter with LoRA) from the trained weights,
a short sample, the lm-eval benchmarks of ``eval.harness_tasks``
(``harness/train-end.json``, and their scores as a metrics record at the last step), the
summary block and ``summary.json``."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from lmforge import fsio
from lmforge.config import JobConfig, harness_task_names
from lmforge.data.build import DataBundle
from lmforge.data.tokenizer import Tokenizer
from lmforge.eval.harness import headline_scores, run_harness
from lmforge.export import export_trained, trained_model
from lmforge.perf.records import HARNESS_DIR
from lmforge.perf.report import write_report
from lmforge.train.metrics import MetricsLogger
from lmforge.train.model_setup import TrainModel, gather_full_state_dict
from lmforge.train.progress import Progress, summary_lines
from lmforge.train.sample import write_sample
from lmforge.train.setup import Runtime, say

# the end-of-training benchmarks, beside bench-eval's (lmforge report reads them all)
HARNESS_FILE = f"{HARNESS_DIR}/train-end.json"


def finish(cfg: JobConfig, rt: Runtime, model: TrainModel, tokenizer: Tokenizer,
           data: DataBundle, out_dir: Path, history: list[dict], logger: MetricsLogger,
           progress: Optional[Progress] = None) -> dict:
    """Export and sample (``train.save``) and benchmark (``eval.harness_tasks``), then
    the summary block and ``summary.json``, which ``logger``'s trackers get with the run's
    plots. The held-out loss is the last step's evaluation (``run_loop``)."""
    progress = progress or Progress(cfg, rt.is_logging_rank, started=rt.started)
    tasks = harness_task_names(cfg.eval.harness_tasks)
    trained = gather_trained(cfg, rt, model) if cfg.train.save or tasks else None
    sample = harness = None
    if trained is not None and cfg.train.save:
        sample = export_and_sample(cfg, rt, trained, tokenizer, data, out_dir)
    if trained is not None and tasks:
        harness = benchmark(cfg, rt, trained, tokenizer, out_dir, tasks, history, logger)
    # the wall time includes export
    summary = {**progress.summary(out_dir, history, rt.device, data), **data.stats,
               **(harness or {})}
    if sample is not None:
        summary["sample"] = sample
    if rt.is_logging_rank:
        kept = {k: v for k, v in summary.items() if k != "sample"}
        fsio.atomic_write_bytes(out_dir / "summary.json", json.dumps(kept, indent=2).encode())
        print("\n".join(summary_lines(summary)), flush=True)
        track_summary(logger, out_dir, kept)
    return summary


def track_summary(logger: MetricsLogger, out_dir: Path, summary: dict) -> None:
    """The summary and the run's plots (``lmforge report``'s, written to RUN/report) to
    the trackers that keep files (MLflow, W&B)."""
    if not logger.keeps_files:
        return
    report = write_report([out_dir])
    if report["missing"]:
        print(f"metrics.tracker: {report['missing']}", flush=True)
    logger.finish(summary, [report["summary"], *report["plots"].values()])


def gather_trained(cfg: JobConfig, rt: Runtime, model: TrainModel):
    """A single-device model holding the trained weights on the logging rank (None on
    the others). Collective: the weights are gathered to rank 0."""
    if model.mesh is not None:
        say(rt, "export: gathering the full weights on rank 0")
    full_sd = gather_full_state_dict(model)
    if not rt.is_logging_rank:
        return None
    return model.parts[0] if model.mesh is None else trained_model(
        model.args, full_sd, cfg.lora)


def export_and_sample(cfg: JobConfig, rt: Runtime, trained, tokenizer: Tokenizer,
                      data: DataBundle, out_dir: Path) -> Optional[str]:
    """``hf/`` (and ``adapter/``) from the trained weights, then a short sample."""
    say(rt, f"export: writing {out_dir / 'hf'}"
             + (f" and {out_dir / 'adapter'}" if cfg.lora.enabled else ""))
    export_trained(cfg, trained, tokenizer, out_dir)
    print(f"\nHugging Face export: {out_dir / 'hf'}")
    return write_sample(cfg, trained, tokenizer, data, rt.autocast)


def benchmark(cfg: JobConfig, rt: Runtime, trained, tokenizer: Tokenizer, out_dir: Path,
              tasks: list[str], history: list[dict], logger: MetricsLogger) -> dict:
    """``eval.harness_tasks`` on the trained model: lm-eval's results in
    ``harness/train-end.json``, the headline scores logged at the last step (metrics.jsonl,
    TensorBoard) like the held-out loss; returns the summary's entries."""
    ev = cfg.eval
    say(rt, f"benchmark: lm-eval {', '.join(tasks)}")
    was_training = trained.training
    trained.eval()
    # (a sharded run's gathered copy is on rank 0's CPU: it is scored there)
    device = next(trained.parameters()).device
    results = run_harness(trained, tokenizer, device, tasks, ev.harness_include_path,
                          ev.harness_limit, ev.harness_num_fewshot, ev.harness_batch_size)
    trained.train(was_training)
    step = history[-1]["step"] if history else cfg.train.max_steps
    scores = headline_scores(results)
    record = {"model": f"the trained model after step {step}", "tasks": tasks,
              "limit": ev.harness_limit, "num_fewshot": ev.harness_num_fewshot,
              "scores": scores, **results}
    (out_dir / HARNESS_FILE).parent.mkdir(exist_ok=True)
    fsio.atomic_write_bytes(out_dir / HARNESS_FILE,
                            (json.dumps(record, indent=2, default=str) + "\n").encode())
    logger.log(step, scores)
    return {"harness": scores, "harness_file": str(out_dir / HARNESS_FILE)}
