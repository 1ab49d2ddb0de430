"""GRPO's loss (Shao et al. 2024, "DeepSeekMath", Eq. 3) and its variants Dr. GRPO (Liu et
al. 2025, "Understanding R1-Zero-Like Training") and DAPO (Yu et al. 2025), on the
per-token log-probabilities of sampled completions, as TRL's GRPOTrainer (1.16) computes
them, so that a TRL recipe's numbers carry over; the test builds TRL's side from TRL.

Notation, per completion i of a group of G completions of one prompt, token t:
  r_i              its reward (rewards.weighted_sum; NaN: no reward applies)
  A_i              its advantage: (r_i - mean_group r) / (std + 1e-4)  (scale_rewards)
  logp, old, ref   the policy's log-probability of the token (temperature-scaled logits,
                   as sampled), the sampling policy's (``old``: the policy of the rollout,
                   equal to logp on the first of rl.num_iterations passes) and the
                   reference model's
  rho = exp(logp - old)                      the importance ratio
  L_t = -min(rho A_i, clip(rho, 1 - eps_low, 1 + eps_high) A_i) + beta KL_t
  KL_t = rho (exp(ref - logp) - (ref - logp) - 1)
       the k3 estimator of KL(pi || ref) (Schulman 2020), weighted by rho as TRL does by
       default (use_bias_correction_kl, DeepSeek-V3.2: the unbiased reverse-KL gradient
       when the samples come from ``old``).
How the per-token losses are averaged (``loss_type``), over a step's completions:
  grpo     mean over completions of each completion's mean over its tokens (the paper)
  dr_grpo  sum over all tokens / (completions x rl.max_completion_length)  (no length bias)
  dapo     sum over all tokens / the step's completion tokens  (token-level, Eq. 8)
The trainer divides a micro-batch's ``loss_sum`` by the step's global count of
``units`` (train.step.normalize_loss), which gives TRL's figure whatever the
micro-batching.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from lmforge.config.keys import RL_LOSS_TYPES as LOSS_TYPES
from lmforge.config.keys import RL_SCALE_REWARDS as SCALE_REWARDS

STD_EPS = 1e-4  # added to the reward std (TRL's)


@dataclass(frozen=True)
class GRPOParams:
    """rl.beta, rl.epsilon, rl.epsilon_high (None: rl.epsilon), rl.loss_type,
    rl.max_completion_length (dr_grpo's constant), rl.mask_truncated_completions."""
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: Optional[float] = None
    loss_type: str = "dapo"
    max_completion_length: int = 256
    mask_truncated_completions: bool = False

    @property
    def eps_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


# ---------------------------------------------------------------- advantages
def nanstd(x: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """The sample standard deviation (n - 1) of the non-NaN values."""
    dims = tuple(range(x.dim())) if dim is None else (dim,)
    mean = torch.nanmean(x, dim=dims, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dims, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dims, keepdim=True) * count / (count - 1)
    return var.sqrt().squeeze(dims) if dim is not None else var.sqrt().reshape(())


def group_advantages(rewards: torch.Tensor, num_generations: int,
                     scale_rewards: str = "group") -> tuple[torch.Tensor, torch.Tensor]:
    """(advantage per completion, whether its reward std is 0), from ``rewards`` (n,)
    laid out as n / G groups of G consecutive completions of one prompt. The baseline is
    the group's mean reward; ``scale_rewards`` divides by the group's std (group), the
    whole batch's (batch, as PPO Lite) or nothing (none, as Dr. GRPO). NaN rewards (no
    reward applies) are left out of the statistics and get advantage 0."""
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"rl.scale_rewards: {scale_rewards!r} is not one of "
                         f"{', '.join(SCALE_REWARDS)}")
    groups = rewards.view(-1, num_generations)
    mean = torch.nanmean(groups, dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = (nanstd(rewards) if rewards.numel() > 1 else rewards.new_zeros(())
               ).expand_as(rewards)
    elif num_generations > 1:
        std = nanstd(groups, dim=1).repeat_interleave(num_generations)
    else:
        std = torch.zeros_like(rewards)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + STD_EPS)
    return torch.nan_to_num(advantages, nan=0.0), torch.isclose(std, torch.zeros_like(std))


# ---------------------------------------------------------------- log-probabilities
def completion_logps(logits: torch.Tensor, completion_ids: torch.Tensor,
                     temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probability of each completion token, the entropy of its distribution), fp32,
    (rows, completion tokens) each, from the logits that predict them (rows, completion
    tokens, vocab) divided by ``temperature``: the distribution the rollout sampled."""
    logp_all = F.log_softmax(logits.float() / temperature, dim=-1)
    logps = logp_all.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logps, entropy


def completion_mask(lengths: torch.Tensor, width: int, truncated: torch.Tensor,
                    mask_truncated: bool = False) -> torch.Tensor:
    """(rows, width) 1.0 on each completion's tokens (its first ``lengths`` positions);
    with rl.mask_truncated_completions a completion cut at the length limit (``truncated``:
    no end token) counts for nothing."""
    mask = (torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]).float()
    return without_truncated(mask, truncated) if mask_truncated else mask


def without_truncated(mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """``mask`` (rows, width) with the rows of the completions cut at the length limit
    (``truncated``, (rows,) bool: no end token) zeroed, as TRL's
    mask_truncated_completions: they add nothing to the loss or the token metrics."""
    return mask * (~truncated.to(mask.device)).to(mask.dtype)[:, None]


# ---------------------------------------------------------------- the loss
def per_token_loss(logps: torch.Tensor, old_logps: Optional[torch.Tensor],
                   ref_logps: Optional[torch.Tensor], advantages: torch.Tensor,
                   p: GRPOParams) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """L_t (rows, tokens) of the module docstring, and the per-token tensors its metrics
    read (the ratio, the KL). ``old_logps`` None: the rollout's own policy (ratio 1 in
    value, its gradient that of logp)."""
    old = logps.detach() if old_logps is None else old_logps
    ratio = torch.exp(logps - old)
    clipped = torch.clamp(ratio, 1 - p.epsilon, 1 + p.eps_high)
    adv = advantages.unsqueeze(1)
    loss = -torch.min(ratio * adv, clipped * adv)
    parts = {"ratio": ratio.detach(), "advantages": adv}
    if p.beta != 0.0:
        diff = ref_logps - logps
        kl = (torch.exp(diff) - diff - 1) * ratio
        loss = loss + p.beta * kl
        parts["kl"] = kl.detach()
    return loss, parts


def units(mask: torch.Tensor, loss_type: str) -> torch.Tensor:
    """What ``loss_sum`` is divided by, counted in a micro-batch (a step sums them):
    completions (grpo, dr_grpo) or completion tokens (dapo)."""
    if loss_type == "dapo":
        return mask.sum()
    return torch.tensor(float(mask.shape[0]), device=mask.device)


def loss_sum(token_loss: torch.Tensor, mask: torch.Tensor, p: GRPOParams) -> torch.Tensor:
    """The micro-batch's share of the step loss before the division by ``units``."""
    masked = token_loss * mask
    if p.loss_type == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum()
    if p.loss_type == "dr_grpo":
        return masked.sum() / p.max_completion_length
    if p.loss_type == "dapo":
        return masked.sum()
    raise ValueError(f"rl.loss_type: {p.loss_type!r} is not one of {', '.join(LOSS_TYPES)}")


def grpo_loss(logps: torch.Tensor, old_logps: Optional[torch.Tensor],
              ref_logps: Optional[torch.Tensor], advantages: torch.Tensor,
              mask: torch.Tensor, p: GRPOParams, entropy: Optional[torch.Tensor] = None
              ) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of one batch that is a whole step (``loss_sum`` / ``units``), and its
    metrics under TRL's names."""
    token_loss, parts = per_token_loss(logps, old_logps, ref_logps, advantages, p)
    loss = loss_sum(token_loss, mask, p) / units(mask, p.loss_type).clamp(min=1.0)
    return loss, step_metrics(parts, mask, p, entropy)


def step_metrics(parts: dict[str, torch.Tensor], mask: torch.Tensor,
                 p: GRPOParams, entropy: Optional[torch.Tensor] = None) -> dict[str, float]:
    """TRL's token-level metrics: ``kl``, ``entropy`` and the clipped fractions
    (``clip_ratio/low_mean``, ``high_mean``, ``region_mean``: means over completion
    tokens; ``low_min``, ``high_max``: over completions of their own means)."""
    def token_mean(x):
        return float((x * mask).sum() / mask.sum().clamp(min=1.0))

    ratio, adv = parts["ratio"], parts["advantages"]
    low = ((ratio < 1 - p.epsilon) & (adv < 0)).float()
    high = ((ratio > 1 + p.eps_high) & (adv > 0)).float()
    out = {"clip_ratio/low_mean": token_mean(low), "clip_ratio/high_mean": token_mean(high),
           "clip_ratio/region_mean": token_mean(torch.maximum(low, high))}
    per_row = mask.sum(-1)
    kept = per_row > 0
    if bool(kept.any()):
        out["clip_ratio/low_min"] = float(((low * mask).sum(-1)[kept] / per_row[kept]).min())
        out["clip_ratio/high_max"] = float(((high * mask).sum(-1)[kept] / per_row[kept]).max())
    else:
        out["clip_ratio/low_min"] = out["clip_ratio/high_max"] = math.nan
    if "kl" in parts:
        out["kl"] = token_mean(parts["kl"])
    if entropy is not None:
        out["entropy"] = token_mean(entropy.detach())
    return out
