"""Low-memory full fine-tuning: bf16 weights, an AdamW whose states are bf16 too, and the
optimizer step fused into the backward pass.

Memory per parameter for AdamW: fp32 weights + grads + two fp32 moments = 16 bytes;
this path needs 2 (bf16 weights) + 4 (two bf16 moments) + the gradient of one parameter
at a time, about 6 bytes: a 7B model's training state drops from ~108 GiB to ~40 GiB
before sharding.

bf16 has an 8-bit mantissa: an update smaller than half a unit in the last place of the
weight is rounded away every time, and fine-tuning updates (lr ~1e-5) mostly are.
Stochastic rounding rounds up with probability equal to the discarded fraction, so the
expected stored value equals the exact fp32 result and small updates accumulate.
"""
from __future__ import annotations

from typing import Iterable

import torch


def rounding_noise(like: torch.Tensor, generator: torch.Generator | None = None
                   ) -> torch.Tensor:
    """Uniform integers in [0, 2^16), the random part of ``stochastic_round_to_bf16``."""
    return torch.empty(like.shape, dtype=torch.int32, device=like.device).random_(
        0, 1 << 16, generator=generator)


def stochastic_round_to_bf16(x: torch.Tensor, generator: torch.Generator | None = None,
                             noise: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 -> bf16, rounding up or down at random in proportion to the remainder.
    ``noise``: from ``rounding_noise``, to share one draw between tensors."""
    bits = x.to(torch.float32, copy=True).view(torch.int32)  # a private copy, edited in place
    if noise is None:
        noise = rounding_noise(bits, generator)
    # Adding noise below the kept 16 bits and truncating carries into the kept part with
    # probability (dropped bits / 2^16), away from zero for either sign. Infinities and
    # NaNs stay non-finite: their exponent bits are all ones and the noise cannot carry
    # out of the mantissa (a NaN whose payload is only in the low 16 bits becomes inf).
    bits.add_(noise).bitwise_and_(-65536)
    return bits.view(torch.float32).to(torch.bfloat16)


class AdamWBF16(torch.optim.Optimizer):
    """AdamW for bf16 parameters with bf16 moments; the arithmetic is done in fp32 and
    stored back with stochastic rounding (fp32 parameters are updated exactly).

    A parameter's rounding noise at step n is drawn from a generator seeded by (seed, the
    parameter's place in the optimizer, n), not from one running stream: a resumed run
    (the step counts are in the optimizer state a checkpoint holds) draws the noise the
    uninterrupted run drew, and the step fused into backward the noise of the ordinary one."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, seed: int = 0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self._seed = seed
        self._generators: dict = {}
        self._place = {id(p): i for i, p in
                       enumerate(p for group in self.param_groups for p in group["params"])}

    def _generator(self, p: torch.Tensor, step: int) -> torch.Generator:
        """The generator of ``p``'s rounding noise at ``step``."""
        if p.device not in self._generators:
            self._generators[p.device] = torch.Generator(device=p.device)
        generator = self._generators[p.device]
        # a seed of its own for each (place, step) pair under a million of either
        return generator.manual_seed(((self._seed * 1_000_003 + self._place[id(p)])
                                      * 1_000_033 + step) % 2**63)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch casts loaded states to their parameter's dtype: the moments of an fp32
        parameter (a LoRA adapter) would come back fp32, twice the memory, and ``step_param``
        would then update them through ``.float()`` aliases. They stay bf16."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    state[key] = state[key].to(torch.bfloat16)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.step_param(p, group)

    @torch.no_grad()
    def step_param(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16)
        beta1, beta2 = group["betas"]
        state["step"] += 1
        step = int(state["step"])
        # Under FSDP2 the parameter, its gradient and its moments are DTensors: the update
        # is elementwise, so each rank updates its own shard.
        weight, grad, exp_avg, exp_avg_sq = (_local(t) for t in (
            p, p.grad, state["exp_avg"], state["exp_avg_sq"]))
        g = grad.float()
        m = exp_avg.float().lerp_(g, 1 - beta1)
        v = exp_avg_sq.float().mul_(beta2).addcmul_(g, g, value=1 - beta2)
        del g
        # One draw of noise serves the moments and the weight: each rounding stays
        # unbiased on its own, and random numbers are the costliest part on a CPU.
        noise = rounding_noise(weight, self._generator(p, step))
        exp_avg.copy_(stochastic_round_to_bf16(m, noise=noise))
        exp_avg_sq.copy_(stochastic_round_to_bf16(v, noise=noise))
        bias1, bias2 = 1 - beta1 ** step, 1 - beta2 ** step
        w = weight.float() if weight.dtype != torch.float32 else weight
        if group["weight_decay"]:
            w.mul_(1 - group["lr"] * group["weight_decay"])
        w.addcdiv_(m, v.div_(bias2).sqrt_().add_(group["eps"]), value=-group["lr"] / bias1)
        if weight.dtype == torch.bfloat16:
            weight.copy_(stochastic_round_to_bf16(w, noise=noise))
        elif w is not weight:
            weight.copy_(w)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor's shard


def fuse_step_into_backward(optimizer: torch.optim.Optimizer) -> None:
    """Update each parameter as soon as its gradient is complete, then free that
    gradient, so full-model gradients never exist at once. Works for optimizers with a
    per-parameter ``step_param(p, group)`` (AdamWBF16); torch optimizers are stepped
    through a one-parameter view of their group."""
    for index, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            p.register_post_accumulate_grad_hook(_make_hook(optimizer, index))


def _make_hook(optimizer, index: int):
    def hook(p: torch.Tensor) -> None:
        # The group found at each step: loading a state dict (a resume) replaces the
        # optimizer's group dicts, and the LR schedule sets the LR in the new ones.
        group = optimizer.param_groups[index]
        if hasattr(optimizer, "step_param"):
            optimizer.step_param(p, group)
        else:
            saved = group["params"]
            group["params"] = [p]
            optimizer.step()
            group["params"] = saved
        p.grad = None

    return hook
