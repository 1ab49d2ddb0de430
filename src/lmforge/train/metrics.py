"""Throughput, FLOPs, MFU and memory; the loggers that write them.

FLOPs per token (training, forward + backward = 3x forward):
    6 * N_matmul + 6 * n_layers * seq_len * dim
N_matmul counts the weights that take part in matrix multiplies (every linear layer and the
output head; the embedding lookup does none). The attention term is 12 * L * S * d for
the score and value products of full attention, halved because a causal mask skips the
upper triangle. docs/metrics.md derives both terms.
"""
from __future__ import annotations

import json
import resource
import sys
import time
import warnings
from pathlib import Path
from typing import Optional

import torch

from lmforge.models.llama import LlamaArgs

# Dense (no sparsity) bf16 tensor-core peaks in TFLOP/s, from the vendors' data sheets.
PEAK_BF16_TFLOPS = {
    "H200": 989.0,
    "H100 SXM": 989.0, "H100 80GB HBM3": 989.0,
    "H100 PCIe": 756.0, "H100 NVL": 835.0,
    "A100": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
    "A10G": 70.0, "A10": 125.0,
    "MI300X": 1307.0,
}


def matmul_params(args: LlamaArgs) -> int:
    attn = args.dim * args.head_dim * (2 * args.n_heads + 2 * args.n_kv_heads)
    ffn = 3 * args.dim * args.ffn_dim
    return args.n_layers * (attn + ffn) + args.dim * args.vocab_size


def flops_per_token(args: LlamaArgs, seq_len: int) -> float:
    return 6.0 * matmul_params(args) + 6.0 * args.n_layers * seq_len * args.dim


def device_peak_flops(device: torch.device) -> Optional[float]:
    """bf16 dense peak of one device in FLOP/s, or None (with a warning) when unknown."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):
        if all(word in name for word in key.split()):
            return PEAK_BF16_TFLOPS[key] * 1e12
    warnings.warn(f"unknown accelerator {name!r}: MFU is not reported (add its dense bf16 "
                  "peak to PEAK_BF16_TFLOPS in lmforge/train/metrics.py)")
    return None


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    # CPU: the process's peak resident set (Linux reports KiB, macOS bytes).
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


class Throughput:
    """Tokens/s and MFU over the steps since the last report."""

    def __init__(self, flops_per_token: float, peak_flops: Optional[float], n_devices: int = 1):
        self.flops_per_token, self.peak_flops, self.n_devices = flops_per_token, peak_flops, n_devices
        self.reset()

    def reset(self) -> None:
        self.tokens, self.start = 0, time.perf_counter()

    def add(self, tokens: int) -> None:
        self.tokens += tokens

    def report(self) -> dict:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        tokens_per_s = self.tokens / elapsed
        tflops = tokens_per_s * self.flops_per_token / self.n_devices / 1e12
        mfu = tflops * 1e12 / self.peak_flops if self.peak_flops else None
        self.reset()
        return {"tokens_per_s": tokens_per_s, "tflops_per_device": tflops, "mfu": mfu}


class MetricsLogger:
    """metrics.jsonl + TensorBoard, written by the logging rank only."""

    def __init__(self, out_dir: Path, enabled: bool = True):
        self.enabled = enabled
        self._jsonl = self._tb = None
        if enabled:
            self._jsonl = open(out_dir / "metrics.jsonl", "a")
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(out_dir / "tensorboard"))

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        record = {"step": step, **metrics}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and value is not None:
                self._tb.add_scalar(key, value, step)
        self._tb.flush()

    def close(self) -> None:
        if self.enabled:
            self._jsonl.close()
            self._tb.close()
