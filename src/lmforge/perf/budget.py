"""Whether a run fits its device's memory, decided before anything is allocated.

``lmforge train`` (and ``train --dry-run``) compares the run's memory estimate per device
(``estimate``: the total ``lmforge estimate`` prints) with the memory of the device the
process will use: a GPU's total memory, or on the CPU the memory the host has available
now (MemAvailable, within a container's cgroup limit), shared by the processes torchrun
starts on the host (LOCAL_WORLD_SIZE). The estimate already counts the CUDA context, the
caching allocator's slack and the Python process, so the budget is the device's memory
itself, with no further headroom.

The estimate is within about 5% of measured peaks (docs/estimate.md), so a run is refused
only when its estimate less that error still exceeds the budget: a refusal then means the
run cannot fit, while a run within 5% over may fit and is let through (it may still run
out of memory). ``train.skip_memory_check=true`` skips the check.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from lmforge.config import ConfigError, JobConfig, resolve_device
from lmforge.job import Job
from lmforge.perf.estimate import GiB, estimate_memory
from lmforge.perf.estimate_setup import Setup
from lmforge.perf.layout_search import peak_gib
from lmforge.perf.rollout import rollout_changes

ESTIMATE_ERROR = 0.05  # docs/estimate.md: the estimate's error, as a share of the peak
MEMINFO = Path("/proc/meminfo")
# A container's memory limit and use: cgroup v2, then v1 (the OOM killer acts on these,
# while /proc/meminfo shows the whole host's memory).
CGROUP_FILES = ((Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current")),
                (Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
                 Path("/sys/fs/cgroup/memory/memory.usage_in_bytes")))
MORE_DEVICES = 64  # the most devices, as a multiple of the run's, a refusal suggests


@dataclass(frozen=True)
class Budget:
    """The memory one process of the run may use, and where that figure comes from."""
    bytes: float
    source: str  # e.g. "the total memory of GPU 0 (NVIDIA H100 80GB HBM3)"


@dataclass(frozen=True)
class MemoryCheck:
    estimate_bytes: float  # per device, as lmforge estimate totals it
    device: str  # cuda | cpu: the device type the estimate is for
    budget: Optional[Budget]  # None: not checked
    unchecked: str = ""  # why not

    @property
    def fits(self) -> bool:
        return (self.budget is None
                or self.estimate_bytes * (1 - ESTIMATE_ERROR) <= self.budget.bytes)

    def describe(self) -> str:
        """One line for ``train --dry-run``."""
        estimate = f"memory: {self.estimate_bytes / GiB:.1f} GiB estimated per device"
        if self.budget is None:
            return f"{estimate}; not checked ({self.unchecked})"
        return (f"{estimate}, {'fits' if self.fits else 'does NOT fit'} in "
                f"{self.budget.bytes / GiB:.1f} GiB ({self.budget.source})")


def check_memory(job: Job, local_rank: int = 0,
                 estimate_bytes: Optional[float] = None) -> MemoryCheck:
    """The run's estimate (``estimate_bytes`` when already made) against the budget of
    the device its process ``local_rank`` will use."""
    if estimate_bytes is None:
        estimate_bytes = estimate_memory(Setup(job)).total_bytes
    if job.config.train.skip_memory_check:
        return MemoryCheck(estimate_bytes, job.device, None, "train.skip_memory_check=true")
    if job.device == "cuda" and not torch.cuda.is_available():  # a dry run elsewhere
        return MemoryCheck(estimate_bytes, job.device, None,
                           "train.device=cuda and no GPU is visible here")
    budget = device_budget(resolve_device(job.device, "train.device", local_rank))
    return MemoryCheck(estimate_bytes, job.device, budget,
                       "" if budget else "this host's available memory is unknown")


def require_fit(job: Job, local_rank: int = 0) -> None:
    """Raises ``ConfigError`` (one line: the estimate, the budget, what to change) when
    the run cannot fit its device; ``lmforge train`` calls it before any set-up."""
    check = check_memory(job, local_rank)
    if not check.fits:
        raise ConfigError(refusal(job, check))


def refusal(job: Job, check: MemoryCheck) -> str:
    """The line: the estimate, the budget, then each change that fits (or lowers the
    estimate) and a larger device as one list of alternatives, then the way past it."""
    budget = check.budget
    options = changes(job.config, job.world_size, check.device,
                      check.estimate_bytes / GiB, budget.bytes / GiB)
    larger = f"a {'GPU' if check.device == 'cuda' else 'machine'} with more memory"
    return (f"memory: the run needs about {check.estimate_bytes / GiB:.1f} GiB per device "
            f"(lmforge estimate) but {budget.source} is {budget.bytes / GiB:.1f} GiB; try "
            f"{one_of([*options, larger])}, or set train.skip_memory_check=true to run "
            f"anyway")


def one_of(options: list[str]) -> str:
    """``a``, ``a or b``, ``a, b or c``: alternatives as a sentence lists them."""
    return " or ".join(options) if len(options) < 3 else \
        f"{', '.join(options[:-1])} or {options[-1]}"


# ----------------------------------------------------------------- what to change

def changes(cfg: JobConfig, world_size: int, device: str, estimate_gib: float,
            budget_gib: float) -> list[str]:
    """Each single change that lowers the estimate by more than its error, with the
    estimate it gives: micro-batch 1, full activation checkpointing, LoRA of
    model.init_from (QLoRA on a GPU), and on GPUs the fewest devices, doubling, whose
    shards fit. (On the CPU more processes share one host's memory: no help.)"""
    out = []
    for text, keys in _single_changes(cfg, device):
        gib = peak_gib(cfg, keys, world_size, device)
        if gib is not None and gib < estimate_gib * (1 - ESTIMATE_ERROR):
            out.append(f"{text} ({gib:.1f} GiB)")
    n = world_size * 2
    while device == "cuda" and n <= world_size * MORE_DEVICES:
        gib = peak_gib(cfg, {"parallel.dp_shard": -1}, n, device)
        if gib is not None and gib * (1 - ESTIMATE_ERROR) <= budget_gib:
            out.append(f"{n} GPUs with parallel.dp_shard=-1 ({gib:.1f} GiB each)")
            break
        n *= 2
    return out


def _single_changes(cfg: JobConfig, device: str) -> list[tuple[str, dict]]:
    out = rollout_changes(cfg)  # GRPO: a smaller group, a shorter completion
    if cfg.data.micro_batch_size > 1:
        out.append(("data.micro_batch_size=1", {"data.micro_batch_size": 1}))
    if cfg.train.activation_checkpointing != "full":
        out.append(("train.activation_checkpointing=full",
                    {"train.activation_checkpointing": "full"}))
    if cfg.model.init_from and not cfg.lora.enabled:  # adapters on a model that is trained
        out.append(("lora.enabled=true", {"lora.enabled": True}))
    elif cfg.lora.enabled and not cfg.lora.quantize and device == "cuda":
        out.append(("lora.quantize=nf4", {"lora.quantize": "nf4"}))
    return out


# ------------------------------------------------------------------------ budgets

def device_budget(device: torch.device) -> Optional[Budget]:
    """A GPU's total memory; on the CPU the host's available memory over the processes
    torchrun starts on it. None when the host does not say."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return Budget(props.total_memory,
                      f"the total memory of GPU {device.index or 0} ({props.name})")
    available = host_available()
    if available is None:
        return None
    processes = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
    amount, source = available
    if processes > 1:
        source += f", per process of the {processes} on it (LOCAL_WORLD_SIZE)"
    return Budget(amount / processes, source)


def host_available() -> Optional[tuple[float, str]]:
    """(bytes, where from): MemAvailable, else the free pages sysconf reports, capped by a
    container's cgroup limit less its use."""
    available = _meminfo_available()
    source = "the memory this host has available (MemAvailable in /proc/meminfo)"
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
        source = "the memory this host has free (sysconf)"
    room = cgroup_room()
    if room is not None and room < available:
        return room, "this container's memory limit less its use (cgroup)"
    return available, source


def _meminfo_available() -> Optional[int]:
    try:
        text = MEMINFO.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024  # kB
    return None


def cgroup_room() -> Optional[int]:
    """A container's memory limit less what it uses; None without a limit."""
    for limit_file, usage_file in CGROUP_FILES:
        try:
            limit, usage = limit_file.read_text().strip(), usage_file.read_text().strip()
        except OSError:
            continue
        if limit.isdigit() and usage.isdigit():
            return max(int(limit) - int(usage), 0)
        return None  # "max": no limit
    return None
