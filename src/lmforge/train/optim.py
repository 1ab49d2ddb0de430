"""Optimizer and learning-rate schedule."""
from __future__ import annotations

import math
import warnings

import torch
from torch import nn

from lmforge.config import OptimConfig
from lmforge.train.low_memory import AdamWBF16, fuse_step_into_backward
from lmforge.train.precision import LossScaler


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW over trainable parameters; matrices decay, norms and biases do not."""
    params = {id(p): p for p in model.parameters() if p.requires_grad}.values()
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    # An empty group (LoRA trains matrices only) would be saved with no parameter to
    # name it, and torch's distributed optimizer state cannot load it back.
    groups = [g for g in ({"params": decay, "weight_decay": cfg.weight_decay},
                          {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    if cfg.name == "adamw_bf16":
        return AdamWBF16(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    fused = cfg.fused
    if fused is None:  # the fused kernel exists for CUDA tensors; CPU uses foreach
        fused = all(p.is_cuda for p in params) and len(decay) > 0
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             fused=fused or None)


def lr_multiplier(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Linear warmup to the peak, then cosine or linear decay to ``min_lr_ratio``.
    ``step`` counts optimizer steps already taken (0 for the first)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    decay_steps = max(1, max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    if cfg.schedule == "cosine":
        shape = 0.5 * (1 + math.cos(math.pi * progress))
    else:
        shape = 1 - progress
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, max_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_multiplier(step, cfg, max_steps))


class Optimizers:
    """One optimizer and LR schedule per model part (pipeline stage), stepped together,
    so each part's optimizer state maps onto that part's parameter names; stepped
    through ``scaler`` (fp16's loss scale; default: none)."""

    def __init__(self, parts: list[nn.Module], cfg: OptimConfig, max_steps: int,
                 scaler: LossScaler | None = None):
        self.optimizers = [build_optimizer(part, cfg) for part in parts]
        self.schedulers = [build_scheduler(o, cfg, max_steps) for o in self.optimizers]
        self.scaler = scaler or LossScaler()
        self.in_backward = cfg.in_backward
        if self.in_backward:
            for o in self.optimizers:
                fuse_step_into_backward(o)

    @property
    def lr(self) -> float:
        return self.optimizers[0].param_groups[0]["lr"]

    def step(self, update: bool = True, step: int = 0) -> None:
        """``update=False`` skips the parameter update (a non-finite step), as the loss
        scaler does when fp16 gradients overflowed, but the schedule still advances, so
        the LR stays a function of the step number (``step``, for messages)."""
        if not self.in_backward:  # in_backward: already applied
            self.scaler.step(self.optimizers, step, update)
        with warnings.catch_warnings():
            # A skipped first update is deliberate: torch would warn that the schedule
            # stepped before the optimizer did.
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler")
            for s in self.schedulers:
                s.step()
        self.zero_grad()

    def zero_grad(self) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=True)

    def scheduler_state(self) -> dict:
        return self.schedulers[0].state_dict()

    def load_scheduler_state(self, state: dict) -> None:
        for s in self.schedulers:
            s.load_state_dict(_per_group_lists_cut(state, len(s.optimizer.param_groups)))


def _per_group_lists_cut(state: dict, groups: int) -> dict:
    """A schedule saved before empty parameter groups were dropped (LoRA checkpoints
    with an empty no-decay group) lists one value per group, the empty one last: keep
    the first ``groups``, which belong to the groups that still exist."""
    return {k: v[:groups] if isinstance(v, list) and len(v) > groups else v
            for k, v in state.items()}
