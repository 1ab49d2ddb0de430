"""A mixture of experts' share of a training step: the load-balancing loss
(``router_aux_loss_coef`` x Switch Transformer's auxiliary loss, as transformers adds it
to the loss it back-propagates) and the expert load, logged as ``moe/aux_loss`` and
``moe/load_max_over_mean``.

Each micro-batch's auxiliary loss is back-propagated divided by the step's micro-batch
count; data parallelism averages the gradients over its ranks. So the step follows the
gradient of coef x (the mean auxiliary loss over micro-batches and ranks), whatever the
split, as one transformers forward of one batch does. The logged ``loss`` stays the
objective's (comparable with ``eval_loss``); the auxiliary loss is logged beside it.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lmforge.models.moe import (MoE, load_balancing_loss, max_load_ratio, take_routings,
                                tokens_per_expert, update_correction_bias)


class ExpertBalance:
    """One step's load-balancing loss and expert load over ``model``'s MoE layers."""

    def __init__(self, model: nn.Module, moes: list[MoE], micro_batches: int):
        self.model, self.moes, self.micro_batches = model, moes, micro_batches
        self.coef = float(getattr(model.args, "router_aux_loss_coef", 0.0))
        self.top_k, n_experts = moes[0].args.top_k, moes[0].args.n_experts
        # On the model's device: no sync per layer, and NCCL reduces them as they are.
        device = moes[0].gate.weight.device
        device = torch.device("cpu") if device.type == "meta" else device
        self.aux_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.counts = torch.zeros(len(moes), n_experts, dtype=torch.float64,
                                  device=device)  # (layers, experts)

    @classmethod
    def of(cls, model: nn.Module, micro_batches: int) -> Optional["ExpertBalance"]:
        """None for a dense model."""
        moes = [m for m in model.modules() if isinstance(m, MoE)]
        return cls(model, moes, micro_batches) if moes else None

    def before_forward(self) -> None:
        """Forget choices this step's loss does not read: those of a forward with
        gradients made outside the step (a caller's own), kept since."""
        take_routings(self.model)

    def loss(self, device: torch.device, like: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The micro-batch's share of coef x aux (its forwards' routings), and the
        expert load it adds up; a replicated DTensor when ``like`` (the objective's loss)
        is one (tensor parallelism's loss_parallel)."""
        share = self._loss(device)
        if isinstance(like, DTensor):  # (every tp rank routed the whole sequence alike)
            return DTensor.from_local(share, like.device_mesh, like.placements, run_check=False)
        return share

    def _loss(self, device: torch.device) -> torch.Tensor:
        logits = []
        for layer, moe in enumerate(self.moes):
            routings, moe.routings = moe.routings, []
            for r in routings:
                logits.append(r.logits)
                self.counts[layer] += tokens_per_expert(r.indices, r.logits.shape[-1]).to(
                    self.counts.device)
        if not logits:  # (a stage or forward without MoE layers)
            return torch.zeros((), device=device)
        aux = load_balancing_loss(logits, self.top_k)
        self.aux_sum += aux.detach().double().to(self.aux_sum.device)
        return aux * (self.coef / self.micro_batches)

    def reduce(self, group=None) -> None:
        """Sum the step's expert counts and average its auxiliary loss over the
        data-parallel ranks (``group``; None: one process), once per step."""
        self.aux_sum = self.aux_sum / self.micro_batches
        if group is not None:
            both = torch.cat([self.aux_sum.reshape(1), self.counts.flatten()])
            dist.all_reduce(both, group=group)
            self.aux_sum = both[0] / dist.get_world_size(group)
            self.counts = both[1:].view_as(self.counts)

    def metrics(self) -> dict[str, float]:
        """The step's mean auxiliary loss and its busiest expert's assignments over the
        mean expert's, in its worst layer (after ``reduce``)."""
        return {"moe/aux_loss": float(self.aux_sum),
                "moe/load_max_over_mean": float(max_load_ratio(self.counts).max())}

    def update_biases(self, step_size: float) -> None:
        """DeepSeek-V3's auxiliary-loss-free balancing (``moe.update_correction_bias``)
        from the step's counts (after ``reduce``: every rank moves them alike)."""
        for moe, counts in zip(self.moes, self.counts):
            update_correction_bias(moe.gate, counts, step_size)
