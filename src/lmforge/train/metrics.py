"""What a training run writes: throughput, memory, and the loggers (metrics.jsonl,
TensorBoard, Weights & Biases).

The FLOPs per token and device peaks behind ``tflops_per_device`` and ``mfu`` are in
``lmforge.perf.flops``; reading a run's records back is ``lmforge.perf.records``.
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

from lmforge import fsio
from lmforge.perf.records import METRICS_FILE, is_finite_number

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

WANDB_ENV = "LMFORGE_WANDB_PROJECT"
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
    """metrics.jsonl + TensorBoard (+ Weights & Biases when asked), logging rank only.

    W&B is on when ``wandb_project`` (``train.wandb_project``) is given, else when
    ``LMFORGE_WANDB_PROJECT`` is set (the key wins over the variable); the ``wandb`` package
    is imported only then, and its absence is a one-line error."""

    def __init__(self, out_dir: Path, enabled: bool = True, wandb_project: Optional[str] = None,
                 run_name: Optional[str] = None, config: Optional[dict] = None,
                 start_step: int = 0):
        """``start_step``: the step the run continues after (0: a fresh run). The records
        of later steps, written before a crash by the invocation that is now being
        repeated, are dropped so that each step appears once; ``earlier`` holds the
        records kept."""
        self.enabled = enabled
        self._jsonl = self._tb = self._wandb = None
        self.earlier: list[dict] = []
        if not enabled:
            return
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        wandb_project = wandb_project or os.environ.get(WANDB_ENV)
        if wandb_project:
            self._wandb = _start_wandb(wandb_project, run_name or out_dir.name, out_dir, config)
        self.earlier = keep_records_until(out_dir / METRICS_FILE, start_step)
        self._jsonl = open(out_dir / METRICS_FILE, "a")
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: TensorBoard hides the events of the repeated steps the same way.
        self._tb = SummaryWriter(str(out_dir / "tensorboard"),
                                 purge_step=start_step + 1 if start_step else None)

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        record = {"step": step, **metrics}
        self._jsonl.write(json.dumps(record, default=_json_default) + "\n")
        self._jsonl.flush()
        numbers = {k: float(v) for k, v in metrics.items() if is_finite_number(v)}
        for key, value in numbers.items():
            self._tb.add_scalar(tensorboard_tag(key), value, step)
        self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({tensorboard_tag(k): v for k, v in numbers.items()}, step=step)

    def close(self) -> None:
        if not self.enabled:
            return
        self._jsonl.close()
        self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        self.enabled = False


def keep_records_until(path: Path, step: int) -> list[dict]:
    """Rewrite ``path`` (atomically) to hold only the records of steps up to ``step``;
    returns them. A torn last line, left by a killed run, is dropped with the rest."""
    if not path.is_file():
        return []
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
    fsio.atomic_write_bytes(path, "".join(lines).encode())
    return kept


def _json_default(value: Any):
    if isinstance(value, torch.Tensor):
        return value.item()
    return str(value)


def _start_wandb(project: str, name: str, out_dir: Path, config: Optional[dict]):
    try:
        import wandb
    except ImportError:
        raise ValueError(f"W&B logging was asked for (project {project!r}) but the wandb "
                         f"package is not installed: pip install wandb, or unset "
                         f"train.wandb_project and {WANDB_ENV}") from None
    return wandb.init(project=project, name=name, dir=str(out_dir), config=config or {})
