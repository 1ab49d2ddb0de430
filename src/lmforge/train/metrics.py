"""What a training run writes: throughput, memory, and the logger (metrics.jsonl, and the
trackers of ``train/trackers.py``: TensorBoard, MLflow, Weights & Biases).

The FLOPs per token and device peaks behind ``tflops_per_device`` and ``mfu`` are in
``lmforge.perf.flops``; reading a run's records back is ``lmforge.perf.records``.
"""
from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

from lmforge import fsio
from lmforge.config import MetricsConfig
from lmforge.perf.records import METRICS_FILE, is_finite_number
from lmforge.train.trackers import failed, start_trackers

# ------------------------------------------------------------------------- memory

def peak_memory_gib(device: torch.device) -> float:
    """Peak memory so far: on a GPU the caching allocator's peak *allocated* bytes; on the
    CPU the process's peak resident set (which includes Python and the libraries)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # Linux KiB, macOS bytes
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def memory_metrics(device: torch.device) -> dict:
    """``peak_mem_gib`` (allocated) and ``peak_reserved_gib`` (held by the caching
    allocator: what nvidia-smi shows, less the CUDA context); reserved is None on CPU."""
    device = torch.device(device)
    reserved = (torch.cuda.max_memory_reserved(device) / 2**30
                if device.type == "cuda" else None)
    return {"peak_mem_gib": peak_memory_gib(device), "peak_reserved_gib": reserved}


# --------------------------------------------------------------------- throughput

class Throughput:
    """Tokens/s, TFLOP/s per device and MFU over the steps since the last report."""

    def __init__(self, flops_per_token: float, peak_flops: Optional[float], n_devices: int = 1):
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.n_devices = max(1, n_devices)
        self.reset()

    def reset(self) -> None:
        self.tokens, self.flops, self.start = 0, 0.0, time.perf_counter()

    def add(self, tokens: int, flops: Optional[float] = None) -> None:
        """``tokens`` positions run over (all devices), costing ``flops`` model FLOPs
        (default: ``flops_per_token`` each; a shorter sequence costs less attention)."""
        self.tokens += tokens
        self.flops += tokens * self.flops_per_token if flops is None else flops

    def report(self) -> dict:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        tokens_per_s = self.tokens / elapsed
        flops_per_device = self.flops / elapsed / self.n_devices
        mfu = flops_per_device / self.peak_flops if self.peak_flops else None
        self.reset()
        return {"tokens_per_s": tokens_per_s, "tflops_per_device": flops_per_device / 1e12,
                "mfu": mfu}


# ------------------------------------------------------------------------ loggers

_TB_GROUPS = {"loss": "loss", "eval_loss": "loss", "lr": "optim", "grad_norm": "optim",
              "tokens_per_s": "perf", "tflops_per_device": "perf", "mfu": "perf",
              "tokens": "progress", "valid_tokens": "progress", "pairs": "progress"}


def tensorboard_tag(key: str) -> str:
    """``loss/loss``, ``perf/mfu``, ``memory/peak_mem_gib``, ...: grouped in the UI."""
    if key.startswith("eval_") and "/" in key:  # eval_rewards/chosen: eval/rewards/chosen
        return f"eval/{key[len('eval_'):]}"
    if key.startswith("harness/"):  # harness/<task>/<metric>: grouped already
        return key
    group = _TB_GROUPS.get(key) or ("memory" if key.endswith("_gib") else "train")
    return f"{group}/{key}"


class MetricsLogger:
    """metrics.jsonl and the trackers of ``metrics`` (``metrics.tracker``: TensorBoard by
    default, MLflow, W&B; ``train/trackers.py``), on the logging rank only."""

    def __init__(self, out_dir: Path, metrics=None, enabled: bool = True,
                 config: Optional[dict] = None, start_step: int = 0):
        """``metrics``: the config's ``metrics`` section (None: its defaults). ``config``:
        the resolved config, the trackers' parameters. ``start_step``: the step the run
        continues after (0: a fresh run). The records of later steps, written before a
        crash by the invocation that is now being repeated, are dropped so that each step
        appears once; ``earlier`` holds the records kept."""
        self.enabled = enabled
        self._jsonl = None
        self.trackers: list = []
        self.earlier: list[dict] = []
        if not enabled:
            return
        self.metrics = metrics or MetricsConfig()
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        self.earlier = records_until(out_dir / METRICS_FILE, start_step)
        self._path, self._start_step = out_dir / METRICS_FILE, start_step  # (see log)
        self.trackers = start_trackers(out_dir, self.metrics, config or {}, start_step)

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        record = {"step": step, **metrics}
        if self._jsonl is None:  # written from the first record on: a refused run has none
            keep_records_until(self._path, self._start_step)
            self._jsonl = open(self._path, "a")
        self._jsonl.write(json.dumps(record, default=_json_default) + "\n")
        self._jsonl.flush()
        numbers = {tensorboard_tag(k): float(v) for k, v in metrics.items()
                   if is_finite_number(v)}
        self._each("log", step, numbers)

    @property
    def keeps_files(self) -> bool:
        """Whether a tracker keeps the run's summary and plots (MLflow, W&B)."""
        return any(t.name != "tensorboard" for t in self.trackers)

    def finish(self, summary: dict, plots: list[Path]) -> None:
        """The run's summary and plots, to the trackers that keep them."""
        if self.enabled:
            self._each("finish", summary, plots)

    def close(self) -> None:
        if not self.enabled:
            return
        if self._jsonl is not None:
            self._jsonl.close()
        self._each("close")
        self.enabled = False

    def _each(self, call: str, *args) -> None:
        """``call`` on every tracker; one that fails is dropped, saying so in one line
        (or stops the run, with ``metrics.tracker_required``)."""
        for tracker in list(self.trackers):
            try:
                getattr(tracker, call)(*args)
            except Exception as exc:  # (a server gone, a full disk: not the run's fault)
                self.trackers.remove(tracker)
                failed(tracker.name, f"failed ({call})", exc, self.metrics.tracker_required)


def keep_records_until(path: Path, step: int) -> list[dict]:
    """Rewrite ``path`` (atomically) to hold only the records of steps up to ``step``;
    returns them. A torn last line, left by a killed run, is dropped with the rest."""
    if not path.is_file():
        return []
    kept, lines = _records_until(path, step)
    fsio.atomic_write_bytes(path, "".join(lines).encode())
    return kept


def records_until(path: Path, step: int) -> list[dict]:
    """The records of steps up to ``step`` in ``path`` (none when it does not exist)."""
    return _records_until(path, step)[0] if path.is_file() else []


def _records_until(path: Path, step: int) -> tuple[list[dict], list[str]]:
    kept, lines = [], []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) \
                and record["step"] <= step:
            kept.append(record)
            lines.append(line + "\n")
    return kept, lines


def _json_default(value: Any):
    if isinstance(value, torch.Tensor):
        return value.item()
    return str(value)
