"""Preference losses on the log-probabilities of chosen and rejected completions: DPO,
IPO, SimPO and ORPO, each written once, with the metrics TRL logs under the same names.
The trainer (``train.objectives``) and ``lmforge eval`` on a preference file both call
``pair_logps`` then ``preference_loss``, so training and evaluation agree.

A preference batch holds ``2n`` sequences (rows, or segments of packed rows): the chosen
completion of pairs 0..n-1, then the rejected ones, in ``slots`` (batch, seq): which of
the 2n sequences a position's target belongs to (-1: none, e.g. the prompt or padding).
Only completion tokens carry a label (``IGNORE_INDEX`` elsewhere).

Notation (per pair): pi_w, pi_l are the policy's summed log-probabilities of the chosen
(w) and rejected (l) completion, rho_w, rho_l the reference model's, |y_w|, |y_l| their
token counts, sigma the logistic function.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lmforge import IGNORE_INDEX
from lmforge.config import PREFERENCE_OBJECTIVES
from lmforge.models.fused_loss import FUSED_CHUNK_TOKENS, fused_token_logps
from lmforge.models.loss import fused_head, model_inputs

NEEDS_REFERENCE = ("dpo", "ipo")  # the objectives that compare with a reference model
# TRL's metric names (ORPO adds nll_loss)
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
           "logps/chosen", "logps/rejected")


@dataclass(frozen=True)
class PreferenceParams:
    """The objectives' parameters (train.beta, train.label_smoothing, train.simpo_gamma,
    train.orpo_lambda)."""
    beta: float = 0.1
    label_smoothing: float = 0.0
    gamma: float = 0.5
    lam: float = 0.1


@dataclass
class PairLogps:
    """Summed completion log-probabilities and token counts, (n,) each."""
    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor


def token_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(label) at each position, in fp32 (0 where there is no label)."""
    return -F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(),
                            ignore_index=IGNORE_INDEX, reduction="none").view(labels.shape)


def sequence_logps(model: nn.Module, batch: dict, device: torch.device,
                   autocast=contextlib.nullcontext, chunk_tokens: int = 0) -> PairLogps:
    """The model's summed log-probabilities of each of the batch's 2n completions.
    ``chunk_tokens`` (train.loss_chunk_tokens): the output layer runs that many tokens at
    a time, each chunk's logits recomputed in backward (``chunked_token_logps``); with
    train.fused_loss the fused head's chunks (``fused_token_logps``)."""
    labels = batch["labels"].to(device)
    if fused_head(model):  # train.fused_loss: the chunks' logits recomputed in backward
        with autocast():
            hidden = model(**model_inputs(batch, device), head=False)
        logps = fused_token_logps(model.output, hidden, labels,
                                  chunk_tokens or FUSED_CHUNK_TOKENS, autocast)
    elif chunk_tokens:
        with autocast():
            hidden = model(**model_inputs(batch, device), head=False)
        logps = chunked_token_logps(model.output, hidden, labels, chunk_tokens, autocast)
    else:
        with autocast():
            logits = model(**model_inputs(batch, device))
        logps = token_logps(logits, labels)  # (under tp: loss_parallel over the vocabulary)
    if hasattr(logps, "full_tensor"):  # a DTensor: every tp rank gets every position's
        logps = logps.full_tensor()
    return pair_logps(logps, labels, batch["slots"].to(device), int(batch["n_pairs"]))


def chunked_token_logps(output: nn.Module, hidden: torch.Tensor, labels: torch.Tensor,
                        chunk_tokens: int, autocast=contextlib.nullcontext) -> torch.Tensor:
    """``token_logps(output(hidden), labels)`` without the whole batch's logits at once:
    ``chunk_tokens`` positions at a time, each chunk under activation checkpointing when
    it needs a gradient (its logits and softmax are recomputed in backward)."""
    flat_hidden, flat_labels = hidden.flatten(0, -2), labels.flatten()

    def chunk_logps(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with autocast():
            logits = output(h)
        return token_logps(logits, y)

    parts = []
    for start in range(0, flat_hidden.shape[0], chunk_tokens):
        h, y = flat_hidden[start:start + chunk_tokens], flat_labels[start:start + chunk_tokens]
        if torch.is_grad_enabled():
            parts.append(checkpoint(chunk_logps, h, y, use_reentrant=False))
        else:
            parts.append(chunk_logps(h, y))
    return torch.cat(parts).view(labels.shape)


def pair_logps(logps: torch.Tensor, labels: torch.Tensor, slots: torch.Tensor,
               n_pairs: int) -> PairLogps:
    """Per-sequence sums of ``logps`` (batch, seq) over each sequence's labelled
    positions, whether its sequences are rows or packed segments."""
    keep = (labels != IGNORE_INDEX) & (slots >= 0)
    index = slots[keep]
    sums = logps.new_zeros(2 * n_pairs).index_add(0, index, logps[keep])
    counts = logps.new_zeros(2 * n_pairs).index_add(0, index, torch.ones_like(logps[keep]))
    return PairLogps(sums[:n_pairs], sums[n_pairs:], counts[:n_pairs], counts[n_pairs:])


def preference_loss(objective: str, policy: PairLogps, reference: Optional[PairLogps],
                    p: PreferenceParams) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(per-pair loss, per-pair metrics under TRL's names), (n,) each."""
    if objective == "dpo":
        return dpo(policy, reference, p.beta, p.label_smoothing)
    if objective == "ipo":
        return ipo(policy, reference, p.beta)
    if objective == "simpo":
        return simpo(policy, p.beta, p.gamma, p.label_smoothing)
    if objective == "orpo":
        return orpo(policy, p.lam)
    raise ValueError(f"train.objective: {objective!r} is not one of "
                     f"{', '.join(PREFERENCE_OBJECTIVES)}")


def dpo(policy: PairLogps, reference: PairLogps, beta: float, label_smoothing: float = 0.0):
    """DPO (Rafailov et al. 2023, Eq. 7), with conservative label smoothing eps (cDPO):

        h = (pi_w - rho_w) - (pi_l - rho_l)
        loss = -(1 - eps) log sigma(beta h) - eps log sigma(-beta h)

    The implicit rewards are beta (pi - rho) (Eq. 5)."""
    chosen, rejected = policy.chosen - reference.chosen, policy.rejected - reference.rejected
    h = beta * (chosen - rejected)
    loss = -(1 - label_smoothing) * F.logsigmoid(h) - label_smoothing * F.logsigmoid(-h)
    return loss, _metrics(beta * chosen, beta * rejected, policy.chosen, policy.rejected)


def ipo(policy: PairLogps, reference: PairLogps, beta: float):
    """IPO (Azar et al. 2023, Eq. 17) with tau = beta, on log-ratios averaged per
    completion token (as TRL, which the authors confirmed):

        h = (pi_w - rho_w) / |y_w| - (pi_l - rho_l) / |y_l|
        loss = (h - 1 / (2 beta))^2"""
    chosen, rejected = policy.chosen - reference.chosen, policy.rejected - reference.rejected
    h = (chosen / policy.chosen_tokens.clamp(min=1)
         - rejected / policy.rejected_tokens.clamp(min=1))
    loss = (h - 1 / (2 * beta)) ** 2
    return loss, _metrics(beta * chosen, beta * rejected, policy.chosen, policy.rejected)


def simpo(policy: PairLogps, beta: float, gamma: float, label_smoothing: float = 0.0):
    """SimPO (Meng et al. 2024, Eq. 6): no reference; the reward is the length-normalised
    log-probability, with a target margin gamma:

        h = beta (pi_w / |y_w| - pi_l / |y_l|) - gamma
        loss = -(1 - eps) log sigma(h) - eps log sigma(-h)"""
    chosen = policy.chosen / policy.chosen_tokens.clamp(min=1)
    rejected = policy.rejected / policy.rejected_tokens.clamp(min=1)
    h = beta * (chosen - rejected) - gamma
    loss = -(1 - label_smoothing) * F.logsigmoid(h) - label_smoothing * F.logsigmoid(-h)
    return loss, _metrics(beta * chosen, beta * rejected, chosen, rejected)


def orpo(policy: PairLogps, lam: float):
    """ORPO (Hong et al. 2024, Eqs. 6-7): the chosen completion's NLL plus an odds-ratio
    term, on log-probabilities averaged per token (p = exp(pi / |y|)):

        log odds(y) = log p - log(1 - p)
        loss = -pi_w / |y_w| - lambda log sigma(log odds(y_w) - log odds(y_l))

    The NLL is each pair's own mean over its chosen tokens (TRL averages over all the
    chosen tokens of a micro-batch, which makes a pair's weight depend on its batch)."""
    chosen = policy.chosen / policy.chosen_tokens.clamp(min=1)
    rejected = policy.rejected / policy.rejected_tokens.clamp(min=1)
    log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
    nll = -chosen
    loss = nll - lam * F.logsigmoid(log_odds)
    metrics = _metrics(lam * chosen, lam * rejected, chosen, rejected)
    metrics["nll_loss"] = nll
    return loss, metrics


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation on either side of -log 2."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)),
                       torch.log(-torch.expm1(x)))


def _metrics(chosen_rewards, rejected_rewards, chosen_logps, rejected_logps) -> dict:
    """TRL's per-pair metrics (their means over the pairs of a step are what it logs)."""
    chosen_rewards, rejected_rewards = chosen_rewards.detach(), rejected_rewards.detach()
    return {"rewards/chosen": chosen_rewards, "rewards/rejected": rejected_rewards,
            "rewards/margins": chosen_rewards - rejected_rewards,
            "rewards/accuracies": (chosen_rewards > rejected_rewards).float(),
            "logps/chosen": chosen_logps.detach(), "logps/rejected": rejected_logps.detach()}
