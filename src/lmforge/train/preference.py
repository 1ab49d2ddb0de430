"""The preference objectives as the trainer's step calls them (``train.objectives``): per
micro-batch, the policy's log-probabilities of each chosen and rejected completion, the
reference model's where the objective needs them, then the loss of
``models.preference`` summed over the pairs (the unit the step normalises by).

Where the reference log-probabilities come from (``reference``):

* ``adapters_off``: a LoRA / QLoRA run's own model with its adapters switched off
  (``peft.adapters_disabled``): the base model, no second copy in memory;
* ``model``: a frozen copy of the starting weights (``reference_model``), sharded like the
  policy (a full-weight run with train.reference=live);
* ``batch``: stored with the data (train.reference=precomputed): the batch's
  ``ref_logps`` (2n,), chosen then rejected;
* ``none``: SimPO and ORPO need none.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from lmforge.models.preference import (NEEDS_REFERENCE, PairLogps, PreferenceParams,
                                       preference_loss, sequence_logps)
from lmforge.peft.lora import adapters_disabled


@dataclass(eq=False)
class Preference:
    """DPO, IPO, SimPO or ORPO (``name``) with its parameters; the unit it counts is a
    pair."""
    name: str
    params: PreferenceParams
    unit = "pairs"  # what it counts, as metrics.jsonl names the count (a class constant)
    reference: str = "none"  # adapters_off | model | batch | none
    reference_model: Optional[nn.Module] = field(default=None, repr=False)

    def count(self, batch: dict) -> int:
        return int(batch["n_pairs"])

    def prepare(self, tm, micro_batches: list[dict], step: int, device: torch.device,
                autocast=contextlib.nullcontext) -> tuple[list[dict], dict]:
        return micro_batches, {}  # (pairs train as they are read)

    def takes_new_batches(self, step: int) -> bool:
        return True  # (every step reads its pairs)

    def loss_sum(self, model: nn.Module, batch: dict, device: torch.device,
                 autocast=contextlib.nullcontext, loss_chunk_tokens: int = 0,
                 stats: Optional[dict] = None) -> torch.Tensor:
        """The sum over the batch's pairs of their losses; ``stats`` (when given) gains
        the sums of TRL's metrics over them."""
        policy = sequence_logps(model, batch, device, autocast, loss_chunk_tokens)
        reference = self.reference_logps(model, batch, device, autocast, loss_chunk_tokens)
        loss, metrics = preference_loss(self.name, policy, reference, self.params)
        if stats is not None:
            add_sums(stats, metrics)
        return loss.sum()

    @torch.no_grad()
    def reference_logps(self, model: nn.Module, batch: dict, device: torch.device,
                        autocast=contextlib.nullcontext,
                        chunk_tokens: int = 0) -> Optional[PairLogps]:
        if self.name not in NEEDS_REFERENCE:
            return None
        if self.reference == "batch":
            return stored_logps(batch, device)
        if self.reference == "adapters_off":
            with adapters_disabled(model):
                return sequence_logps(model, batch, device, autocast, chunk_tokens)
        if self.reference == "model":
            return sequence_logps(self.reference_model, batch, device, autocast, chunk_tokens)
        raise ValueError(f"{self.name}: no reference log-probabilities ({self.reference!r})")

    def stage_loss_sum(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        raise ValueError("parallel.pp: the preference objectives do not run in a pipeline")

    def held_out(self, tm, batches, device: torch.device, autocast) -> dict[str, float]:
        return held_out_pairs(self, tm, batches, device, autocast)


def stored_logps(batch: dict, device: torch.device) -> PairLogps:
    """The reference log-probabilities a precomputed pass stored with the data."""
    n = int(batch["n_pairs"])
    ref = batch["ref_logps"].to(device)
    counts = torch.ones(n, device=device)  # (the objectives that read counts use the policy's)
    return PairLogps(ref[:n], ref[n:], counts, counts)


def add_sums(stats: dict, metrics: dict) -> None:
    for name, values in metrics.items():
        total = values.detach().double().sum()
        stats[name] = stats[name] + total if name in stats else total


def mean_stats(stats: dict, dims, units: int) -> dict[str, float]:
    """The step's (or a held-out pass's) metric sums over every data-parallel rank,
    divided by the global count of pairs ``units``: TRL's means. A stat named ``..._min``
    or ``..._max`` is an extreme, reduced as one (GRPO's clip_ratio/low_min; None where
    no rank had a value: +-inf)."""
    if not stats:
        return {}
    extremes = sorted(n for n in stats if n.endswith(("_min", "_max")))
    names = sorted(n for n in stats if n not in extremes)
    sums = torch.stack([stats[n].double() for n in names]) if names else None
    out = {}
    if dims.mesh is not None and dims.dp > 1:
        if names:
            torch.distributed.all_reduce(sums, group=dims.group("dp"))
        for n in extremes:
            op = torch.distributed.ReduceOp.MIN if n.endswith("_min") else \
                torch.distributed.ReduceOp.MAX
            torch.distributed.all_reduce(stats[n], op=op, group=dims.group("dp"))
    for n in extremes:
        value = float(stats[n])
        out[n] = value if math.isfinite(value) else None
    if names:
        out.update({n: float(v) / max(units, 1) for n, v in zip(names, sums.tolist())})
    return out


@torch.no_grad()
def held_out_pairs(objective: Preference, tm, batches, device: torch.device,
                   autocast) -> dict[str, float]:
    """``eval_loss`` (the mean per-pair loss), ``eval_pairs`` and TRL's metrics as
    ``eval_rewards/...`` over the held-out pairs of every data-parallel rank."""
    model = tm.parts[0]
    was_training = model.training
    model.eval()
    stats: dict = {}
    loss = torch.zeros((), dtype=torch.float64, device=device)
    pairs = 0
    for batch in batches:
        loss += objective.loss_sum(model, batch, device, autocast, stats=stats).double()
        pairs += objective.count(batch)
    model.train(was_training)
    stats["loss"] = loss
    stats["pairs"] = loss.new_tensor(float(pairs))
    means = mean_stats(stats, tm.dims, 1)
    total_pairs = means.pop("pairs")
    if total_pairs == 0:
        raise ValueError("the held-out data has no pairs")
    return {"eval_pairs": int(total_pairs),
            **{f"eval_{n}": v / total_pairs for n, v in means.items()}}
