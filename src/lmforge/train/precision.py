"""Mixed precision: what the model computes in, and fp16's dynamic loss scaling.

bf16 keeps fp32's exponent range, so computing in it needs nothing more. fp16 (for GPUs
without bf16: V100, T4) tops out at 65504 and flushes gradients below ~6e-8 to zero, so
an fp16 run multiplies the loss by a scale before backward (small gradients stay
representable), divides the gradients by it before their norm is taken, and skips any
step whose gradients overflowed anyway, halving the scale; after ``GROWTH_INTERVAL`` good
steps in a row the scale doubles again (``torch.amp.GradScaler``'s rule and defaults).
The weights stay fp32 ("master weights").
"""
from __future__ import annotations

import contextlib
import functools
import sys
import warnings
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from lmforge.job import Job
from lmforge.models.moe import GroupedExperts

LOW_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16}
INIT_SCALE = 2.0**16  # the first loss scale
GROWTH_INTERVAL = 2000  # overflow-free steps before the scale doubles


def mixed_precision(compute: str, device_type: str, uses_fsdp: bool
                    ) -> tuple[object, Optional[torch.dtype]]:
    """(autocast factory, FSDP2 parameter dtype) for the compute dtype ``compute``
    (``config.compute_dtype``). Under FSDP2 the fp32 parameters are cast when gathered
    and gradients reduced in fp32; elsewhere autocast casts them op by op."""
    low = LOW_PRECISION.get(compute)
    if low is None:
        return contextlib.nullcontext, None
    if uses_fsdp:
        return contextlib.nullcontext, low
    return functools.partial(torch.autocast, device_type, dtype=low), None


def device_notes(compute: str, device_type: str) -> list[str]:
    """What a user should know about computing in ``compute`` on ``device_type``."""
    if compute == "fp16" and device_type == "cpu":
        return ["train.dtype=fp16 on the CPU: autocast computes matmuls in fp16, which CPUs "
                "without fp16 arithmetic (AVX512-FP16, AMX-FP16) emulate, several times "
                "slower than fp32: a way to check an fp16 run, not to speed one up"]
    return []


class LossScaler:
    """fp16's dynamic loss scale; with ``enabled=False`` (fp32, bf16) it scales nothing
    and ``step`` simply steps the optimizers.

    Whether a step overflowed must be one verdict on every rank, or the ranks' weights
    and scales would part. ``GradScaler`` decides per process: under FSDP2, DTensor
    reduces its found-inf flag over the dimensions a gradient is sharded on, but not over
    pipeline stages (disjoint parameters), nor replicated placements. With a process
    group, ``ShardedGradScaler`` (a GradScaler) all-reduces the flag over the whole world
    in every ``unscale_``, so every mesh dimension agrees."""

    def __init__(self, enabled: bool = False, init_scale: float = INIT_SCALE,
                 growth_interval: int = GROWTH_INTERVAL,
                 device: torch.device = torch.device("cpu"), announce: bool = False):
        if enabled and dist.is_initialized():
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(device.type, init_scale=init_scale,
                                            growth_interval=growth_interval,
                                            process_group=dist.group.WORLD)
        else:
            self.scaler = torch.amp.GradScaler(device.type, init_scale=init_scale,
                                               growth_interval=growth_interval,
                                               enabled=enabled)
        if enabled:
            # GradScaler creates its scale on the first loss it scales; a pipeline stage
            # without the loss never scales one but unscales its gradients all the same.
            self.scaler.scale(torch.zeros((), device=device))
        self.announce = announce  # print skipped steps (the logging rank)
        self.skipped_steps = 0
        self.step_scale = init_scale  # the scale the latest step's backward used

    @classmethod
    def for_job(cls, job: Job, device: torch.device, announce: bool) -> "LossScaler":
        return cls(job.compute == "fp16", INIT_SCALE, GROWTH_INTERVAL,
                   device, announce)

    @property
    def enabled(self) -> bool:
        return self.scaler.is_enabled()

    @property
    def scale(self) -> float:
        """What the loss is multiplied by before backward (1 when disabled). A power of
        two, so scaling and unscaling round nothing."""
        return self.scaler.get_scale()

    def unscale(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Divides the step's gradients by the scale (and notes any overflow): call once
        per step, after the last backward and before gradient clipping."""
        with warnings.catch_warnings():
            # ShardedGradScaler's flag has shape (1,), which DTensor warns of at every
            # step when it meets sharded gradients; the value is right.
            warnings.filterwarnings("ignore", message=r"Found a non-scalar tensor with numel=1")
            for optimizer in optimizers:
                self.scaler.unscale_(optimizer)

    def step(self, optimizers: list[torch.optim.Optimizer], step: int,
             update: bool = True) -> None:
        """Steps the optimizers unless ``update`` is False or the gradients overflowed
        (skipped: weights and optimizer state untouched); then adapts the scale."""
        if update:
            for optimizer in optimizers:
                self.scaler.step(optimizer)  # (skipped on an overflow)
        if not self.enabled:
            return
        self.step_scale = self.scaler.get_scale()
        self.scaler.update()
        # The scale only ever falls by backing off from an overflow.
        if update and self.scaler.get_scale() < self.step_scale:
            self.skipped_steps += 1
            if self.announce:
                print(f"step {step}: fp16 gradients overflowed at loss scale "
                      f"{self.step_scale:g}; update skipped, loss scale now "
                      f"{self.scaler.get_scale():g}", file=sys.stderr, flush=True)

    def metrics(self) -> dict:
        """``loss_scale`` (this step's) and ``skipped_steps`` (so far) for the records."""
        if not self.enabled:
            return {}
        return {"loss_scale": self.step_scale, "skipped_steps": self.skipped_steps}

    def state_dict(self) -> dict:
        if not self.enabled:
            return {}
        state = self.scaler.state_dict()
        return {"scale": state["scale"], "growth_tracker": state["_growth_tracker"],
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: Optional[dict]) -> None:
        """Continues a saved scale; None or {} (a checkpoint of a run that did not scale)
        keeps the initial one."""
        if not self.enabled or not state:
            return
        self.scaler.load_state_dict({**self.scaler.state_dict(), "scale": state["scale"],
                                     "_growth_tracker": state["growth_tracker"]})
        self.skipped_steps = int(state["skipped_steps"])
        self.step_scale = float(state["scale"])


def frozen_linears_to_bf16(model: nn.Module) -> None:
    """Store frozen projection weights (and an MoE's frozen stacked experts) in bf16 when
    computing in bf16 anyway: autocast would otherwise keep a bf16 copy of every frozen
    fp32 weight until backward (half again the base model's size). Embeddings, norms,
    biases and a tied head stay fp32."""
    tied = getattr(model, "output", None) is not None and model.args.tie_embeddings
    for name, module in model.named_modules():
        if isinstance(module, GroupedExperts):
            for weight in (module.gate_up_proj, module.down_proj):
                if not weight.requires_grad:
                    weight.data = weight.data.to(torch.bfloat16)
        if not isinstance(module, nn.Linear) or module.weight.requires_grad:
            continue
        if tied and module is model.output:
            continue
        module.weight.data = module.weight.data.to(torch.bfloat16)
