"""``data.micro_batch_size=auto``: the largest micro-batch whose memory estimate fits the
device less a margin, with data.global_batch_size kept by gradient accumulation.

The margin is ``layout_search.MEMORY_MARGIN`` (5%), the one ``lmforge plan`` keeps, so
that plan on one GPU proposes what the run picks. Why 5%: on the H200 the estimate's
total was within 3.1% of the measured peak on 15 of 17 paths, and where it missed by more
it over-predicted (compile, one-process FSDP2: docs/benchmarks.md); 5% covers the worst
under-prediction seen (-3.0%, packed SFT with a dense mask) with room to spare, and the
total already holds the CUDA context and 10% allocator slack.

The search: the candidates are the divisors of each rank's share of the global batch
(data.global_batch_size / dp), so the global batch is exactly the one asked for; a larger
micro-batch that fits but does not divide that share is not taken, and the printed line
says so. Without data.global_batch_size the global batch is one micro-batch per rank, so
it follows the pick; the candidates are then 1 .. ``AUTO_LIMIT``. The estimate grows with
the micro-batch, so a binary search over the candidates finds the largest that fits.

On the CPU auto is refused: a CPU gains no speed from a larger micro-batch (its matmuls
are saturated by one sequence), so the largest that fits its memory only makes each step
slower, and the host's available memory moves with every other process on it.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional

from lmforge.config import (AUTO, ConfigError, JobConfig, resolve_device, resolve_layout,
                            set_field)
from lmforge.job import Job, resolve
from lmforge.perf.budget import Budget, changes, device_budget, one_of
from lmforge.perf.estimate import GiB, estimate_memory, largest_fitting
from lmforge.perf.estimate_setup import setup_from_config
from lmforge.perf.layout_search import (MEMORY_MARGIN, PlanResult, budget_gib, divisors,
                                        evaluate, layouts, plan_args, with_keys)
from lmforge.perf.timing import Device

AUTO_LIMIT = 1024  # the largest micro-batch auto tries without data.global_batch_size
KEY = "data.micro_batch_size"


@dataclass(frozen=True)
class AutoBatch:
    """What auto picked and why: the printed line says it all."""
    micro_batch: int
    estimate_bytes: float  # the pick's estimated total per device
    next_bytes: Optional[float]  # the next larger candidate's (None: none was larger)
    next_size: Optional[int]
    larger_fits: bool  # a larger micro-batch fits but does not divide the share
    share: Optional[int]  # sequences each rank runs per step (None: global batch unset)
    accumulation: int
    dp: int
    budget: Budget


def with_micro_batch(cfg: JobConfig, size) -> JobConfig:
    out = copy.deepcopy(cfg)
    set_field(out, KEY, size)
    return out


def micro_batch_choices(cfg: JobConfig, dp: int) -> list[int]:
    """The micro-batches auto may pick: those that keep data.global_batch_size (with
    optim.in_backward, which cannot accumulate, only the whole share), else 1..limit."""
    gbs = cfg.data.global_batch_size
    if gbs is None:
        return list(range(1, AUTO_LIMIT + 1))
    share = gbs // dp
    return [share] if cfg.optim.in_backward else divisors(share)


def auto_budget(device_type: str, local_rank: int = 0) -> Budget:
    """The device memory auto fits: a GPU's total memory (``budget.device_budget``); on
    the CPU, a refusal (the module's docstring says why). Tests replace this function."""
    if device_type != "cuda":
        raise ConfigError("data.micro_batch_size: auto sizes the micro-batch to a GPU's "
                          "memory, and this run is on the CPU (train.device); give a number "
                          "(a CPU gains no speed from a larger micro-batch, and the memory "
                          "it has free moves with every other process)")
    return device_budget(resolve_device("cuda", "train.device", local_rank))


def pick_micro_batch(cfg: JobConfig, world_size: int, budget: Budget,
                     device: Optional[str] = None, distributed: Optional[bool] = None,
                     margin: float = MEMORY_MARGIN) -> AutoBatch:
    """The largest micro-batch of ``cfg`` (micro_batch_size=auto) whose estimate fits
    ``budget`` less ``margin``; ``ConfigError`` when not even one sequence does."""
    return _pick(cfg, _base(cfg, world_size, distributed, device), world_size, budget,
                 margin)


def _base(cfg: JobConfig, world_size: int, distributed: Optional[bool],
          device: Optional[str] = None) -> Job:
    """``cfg`` resolved at its smallest choice: every check but the memory, once, and the
    model the trials share."""
    cfg.validate(world_size, distributed)  # (auto's own rules first)
    layout = resolve_layout(cfg.parallel, world_size)
    smallest = micro_batch_choices(cfg, layout["dp_replicate"] * layout["dp_shard"])[0]
    return resolve(with_micro_batch(cfg, smallest), world_size, distributed=distributed,
                   device=device)


def _pick(cfg: JobConfig, base: Job, world_size: int, budget: Budget,
          margin: float) -> AutoBatch:
    dp, usable = base.layout.dp, budget.bytes * (1 - margin)
    choices, sizes = micro_batch_choices(cfg, dp), {}

    def total(b: int) -> float:
        if b not in sizes:  # (one that does not divide the share: as its own global batch)
            keys = {KEY: b} if b in choices else {KEY: b, "data.global_batch_size": None}
            trial = setup_from_config(with_keys(cfg, keys), device=base.device,
                                      world_size=world_size, args=base.args)
            sizes[b] = estimate_memory(trial).total_bytes
        return sizes[b]

    picked = largest_fitting(choices, lambda b: total(b) <= usable)
    if picked is None:
        raise ConfigError(no_fit(base.config, world_size, total(choices[0]), usable,
                                 budget, margin, choices[0]))
    share = None if cfg.data.global_batch_size is None else cfg.data.global_batch_size // dp
    bigger = next((b for b in choices if b > picked), None)
    # (the estimate grows with the micro-batch: if picked + 1 does not fit, nothing larger)
    larger_fits = share is not None and picked < share and total(picked + 1) <= usable
    return AutoBatch(picked, total(picked), None if bigger is None else total(bigger),
                     bigger, larger_fits, share, share // picked if share else 1, dp, budget)


def no_fit(cfg: JobConfig, world_size: int, need: float, usable: float, budget: Budget,
           margin: float, smallest: int) -> str:
    options = changes(cfg, world_size, "cuda", need / GiB, usable / GiB)
    return (f"data.micro_batch_size: auto found no micro-batch that fits: {smallest} "
            f"sequence(s) need about {need / GiB:.1f} GiB per device (lmforge estimate), "
            f"{usable / GiB:.1f} GiB usable ({budget.bytes / GiB:.1f} GiB, {budget.source}, "
            f"less a {margin:.0%} margin); try {one_of([*options, 'a larger GPU'])}")


def describe(auto: AutoBatch, margin: float = MEMORY_MARGIN) -> str:
    """The one line a run prints: the pick, the estimate against the budget, the global
    batch and how it is made."""
    b = auto.budget
    fit = (f"{_gib(auto.estimate_bytes)} GiB estimated per device of "
           f"{_gib(b.bytes * (1 - margin))} usable ({_gib(b.bytes)} GiB, {b.source}, "
           f"less a {margin:.0%} margin)")
    if auto.next_size is not None:
        fit += f"; {auto.next_size} would need {_gib(auto.next_bytes)}"
    if auto.larger_fits:
        fit += (f"; a larger one fits but does not divide the {auto.share} sequences each "
                f"rank runs per step")
    ranks = f"{auto.dp} rank{'s' if auto.dp > 1 else ''}"
    if auto.share is None:
        batch = (f"global batch {auto.micro_batch * auto.dp} = {auto.micro_batch} x {ranks} "
                 f"(data.global_batch_size unset: one micro-batch per rank)")
    else:
        batch = (f"global batch {auto.share * auto.dp} (data.global_batch_size) = "
                 f"{auto.micro_batch} x {auto.accumulation} accumulated x {ranks}")
    return f"data.micro_batch_size=auto: {auto.micro_batch} ({fit}); {batch}"


def _gib(n: float) -> str:
    """GiB with the digits that tell neighbouring micro-batches apart on a small model."""
    return f"{n / GiB:.1f}" if n >= 10 * GiB else f"{n / GiB:.2f}"


def size_micro_batch(cfg: JobConfig, world_size: int, distributed: Optional[bool] = None,
                     local_rank: int = 0) -> tuple[JobConfig, Optional[str]]:
    """``cfg`` with data.micro_batch_size=auto made a number for this machine's device,
    and the line that says so (None, and ``cfg`` itself, when it is a number already)."""
    if cfg.data.micro_batch_size != AUTO:
        return cfg, None
    base = _base(cfg, world_size, distributed)
    auto = _pick(cfg, base, world_size, auto_budget(base.device, local_rank), MEMORY_MARGIN)
    return with_micro_batch(cfg, auto.micro_batch), describe(auto)


def checked_as_number(cfg: JobConfig) -> JobConfig:
    """``cfg`` for a command that checks a config it does not run (a launch script): with
    auto, micro-batch 1 stands in (the run sizes it on its own device)."""
    return with_micro_batch(cfg, 1) if cfg.data.micro_batch_size == AUTO else cfg


def plan_auto(cfg: JobConfig, gpus: int, per_node: int, device: Device) -> PlanResult:
    """``lmforge plan`` of a config with micro_batch_size=auto: each layout at the largest
    micro-batch that fits (the run's rule and margin), fastest first; on one GPU the
    config's own layout gets what ``lmforge train`` would pick on that memory."""
    result, seen = PlanResult(), set()
    gbs = cfg.data.global_batch_size
    for keys in layouts(with_micro_batch(cfg, 1), plan_args(cfg), gpus, per_node):
        rest = {**{k: v for k, v in keys.items() if k != KEY}, "data.global_batch_size": gbs}
        dp = rest["parallel.dp_replicate"] * rest["parallel.dp_shard"]
        if tuple(rest.items()) in seen or (gbs is not None and gbs % dp):
            continue
        seen.add(tuple(rest.items()))
        tried: dict = {}

        def fits(b: int) -> bool:
            tried[b] = evaluate(cfg, {**rest, KEY: b}, gpus, per_node, device)
            return tried[b] is not None and tried[b].peak_gib <= budget_gib(device)

        best = largest_fitting(micro_batch_choices(with_keys(cfg, rest), dp), fits)
        result.tried += any(c is not None for c in tried.values())
        if best is not None:
            result.candidates.append(tried[best])
    result.candidates.sort(key=lambda c: (c.time.total, c.peak_gib))
    return result
