"""One optimizer step's worth of forward/backward.

The loss of a step is the sum of the token cross-entropies over all its micro-batches
divided by the number of valid (label != -100) tokens in the whole step, so it does not
depend on how the step is split into micro-batches or how padding falls; every layout
normalises with ``normalize_loss``. A step whose loss or gradient norm is not finite is
skipped or stops the run (``check_finite``). ``StepResult`` is what the trainer's one
step (``loop.train_step``) reports.
"""
from __future__ import annotations

import contextlib
import math
import sys
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn

from lmforge.parallel import full_value
from lmforge.parallel.mesh import ParallelDims
from lmforge.train.balance import ExpertBalance
from lmforge.train.objectives import NEXT_TOKEN


def normalize_loss(loss_sum: torch.Tensor, n_valid: int, dp: int = 1) -> torch.Tensor:
    """``loss_sum`` (a sum of token cross-entropies) as its share of the step loss

        loss = (sum of the token cross-entropies of the step) / N,

    N = the step's valid (label != -100) tokens on all data-parallel ranks together
    (``step_counts``; at least 1, so a step of only padding gives 0, not NaN).
    What is back-propagated is ``loss_sum * dp / N`` in every layout:

    - gradient accumulation: each micro-batch's sum is divided by the whole step's N, not
      by its own count, so splitting a step into micro-batches changes nothing;
    - data parallel (DDP, FSDP2, HSDP): each rank holds its own micro-batches' sums, and
      the wrapper averages gradients over the dp ranks, so ``x dp`` turns that average
      into the sum the formula needs (``dp=1``: the plain value, as logged);
    - context parallel: each cp rank's sum covers its chunks of the sequences, and FSDP
      averages over dp x cp ranks, so the factor is dp x cp;
    - tensor / sequence parallel: the tp ranks of a data-parallel group load the same
      batch and, under ``loss_parallel``, each holds the whole (replicated) loss sum, so
      they back-propagate the same value and N counts that batch once;
    - pipeline parallel: the schedule calls this for each pipeline microbatch on the last
      stage, with the step's N, and does not rescale gradients (``scale_grads=False``).
    """
    return loss_sum * (dp / max(n_valid, 1))


def count_valid_tokens(batches: Iterable[dict], objective=NEXT_TOKEN) -> int:
    """The units ``objective`` normalises by in ``batches``: labelled tokens, or pairs."""
    return sum(objective.count(b) for b in batches)


@dataclass
class StepCounts:
    """What one step ran over, on all data-parallel ranks together."""
    valid: int  # tokens with a target, or pairs (the objective's units): N of normalize_loss
    positions: int  # positions the model ran over (rows x length, padding included)
    flops: float  # model FLOPs of those positions (0 without a flops_per_token)


def step_counts(micro_batches: list[dict], dims: ParallelDims, device: torch.device,
                flops_per_token: Optional[Callable[[int], float]] = None,
                objective=NEXT_TOKEN) -> StepCounts:
    """The step's counts summed over all data-parallel ranks (one all-reduce): ranks and
    micro-batches may differ in length (SFT batches are padded to their longest sample),
    and the attention's FLOPs per token grow with it (``flops_per_token(length)``). Every
    cp, tp and pp rank of a data-parallel group loads the same (whole) batch, so the world
    sum counts each cp x tp x pp times. float64 holds the counts exactly (below 2**53)."""
    local = [float(count_valid_tokens(micro_batches, objective)), 0.0, 0.0]
    for batch in micro_batches:
        rows, length = batch["input_ids"].shape
        local[1] += rows * length
        local[2] += rows * length * (flops_per_token(length) if flops_per_token else 0.0)
    if dims.mesh is not None:
        total = torch.tensor(local, dtype=torch.float64, device=device)
        dist.all_reduce(total)
        local = (total / (dims.tp * dims.pp * dims.cp)).tolist()
    return StepCounts(round(local[0]), round(local[1]), local[2])


def global_step_loss(local: torch.Tensor, dims: ParallelDims) -> torch.Tensor:
    """The step loss, the same on every rank, from each rank's ``normalize_loss`` share
    (dp=1): tp ranks hold copies, and only last pipeline stages hold any."""
    if dims.mesh is None:
        return local
    total = local.detach().clone().float()
    dist.all_reduce(total)
    return total / dims.tp


def accumulate_gradients(model: nn.Module, micro_batches: list[dict], device: torch.device,
                         autocast=contextlib.nullcontext, n_valid: int | None = None,
                         dp: int = 1, loss_chunk_tokens: int = 0,
                         loss_scale: float = 1.0, objective=NEXT_TOKEN,
                         stats: Optional[dict] = None,
                         balance: Optional[ExpertBalance] = None) -> torch.Tensor:
    """Forward/backward over the micro-batches of one step; returns this rank's share of
    the step loss. ``n_valid``, ``dp``: see ``normalize_loss`` (default: this rank's own
    valid tokens, one process). ``loss_chunk_tokens``: see ``chunked_loss_sum`` (0: the
    whole micro-batch's logits at once). ``loss_scale``: what each micro-batch's
    back-propagated loss is multiplied by (fp16: ``precision.LossScaler``).
    ``objective``: what each micro-batch's loss sum is (``train.objectives``); ``stats``
    (when given) gains the sums of its metrics over the step's units. ``balance``: a
    mixture of experts' load-balancing loss, added to what is back-propagated.
    """
    if n_valid is None:
        n_valid = count_valid_tokens(micro_batches, objective)
    loss_sum = torch.zeros((), device=device)
    for batch in micro_batches:
        if balance is not None:
            balance.before_forward()
        micro_loss = objective.loss_sum(model, batch, device, autocast, loss_chunk_tokens,
                                        stats=stats)
        loss = normalize_loss(micro_loss, n_valid, dp)
        if balance is not None:
            loss = loss + balance.loss(device, like=loss)
        (loss * loss_scale).backward()
        loss_sum += full_value(micro_loss)  # (a replicated DTensor under loss parallel)
    return normalize_loss(loss_sum, n_valid)


def sample_ids(micro_batches: list[dict]) -> dict:
    """``{"sample_ids": [...]}``: the dataset indices of a step's samples, in order."""
    return {"sample_ids": [int(i) for b in micro_batches for i in b.get("sample_ids", [])]}


class NonFiniteError(FloatingPointError):
    """A NaN/Inf loss or gradient norm under ``train.on_nonfinite: stop``."""


@dataclass
class StepResult:
    """What one optimizer step did (``loop.train_step``)."""
    loss: torch.Tensor  # the step loss, the same on every rank
    local_loss: torch.Tensor  # this rank's share of it (``normalize_loss``, dp=1)
    grad_norm: Optional[torch.Tensor]  # before clipping; None under optim.in_backward
    counts: StepCounts  # the step's valid tokens, positions and FLOPs (all dp ranks)
    lr: float  # the learning rate of the update
    # False: a non-finite loss or grad norm, update skipped (train.on_nonfinite=skip).
    # An fp16 overflow is the loss scaler's to skip (``LossScaler.skipped_steps``).
    finite: bool
    metrics: dict = field(default_factory=dict)  # the objective's (preference: TRL's)

    @property
    def n_valid(self) -> int:
        return self.counts.valid


def check_finite(rt, step: int, local_loss: torch.Tensor, loss: torch.Tensor,
                 grad_norm: Optional[torch.Tensor], micro_batches: list[dict],
                 on_nonfinite: str) -> bool:
    """True when the step may update the weights. Every rank reaches the same verdict
    (loss and grad norm are global); each rank whose own loss is non-finite says so with
    its sample ids, so the bad data can be found. ``rt``: the run's Runtime;
    ``on_nonfinite``: train.on_nonfinite."""
    if math.isfinite(float(loss)) and (grad_norm is None or math.isfinite(float(grad_norm))):
        return True
    if not math.isfinite(float(local_loss)):
        print(f"rank {rt.rank}: step {step}: non-finite loss {float(local_loss)} on samples "
              f"{sample_ids(micro_batches)['sample_ids']}", file=sys.stderr, flush=True)
    what = f"step {step}: non-finite loss ({float(loss)}) or grad norm ({grad_norm})"
    if on_nonfinite == "stop":
        raise NonFiniteError(f"{what}; stopped without saving (train.on_nonfinite=stop)")
    if rt.is_logging_rank:
        print(f"{what}; update skipped (train.on_nonfinite=skip)", file=sys.stderr, flush=True)
    return False
