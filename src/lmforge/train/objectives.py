"""What a training step minimises: an objective is a small object the step calls, not a
branch in the loop, so a new one (the preference losses of DPO and its kin) is a new
object here.

An objective returns, per micro-batch, the SUM of its per-unit losses over the units that
count (``loss_sum``; a pipeline's last stage calls ``stage_loss_sum`` on the logits it
produced), and the trainer divides by the step's global count of those units
(``train.step.normalize_loss``), whatever the micro-batching, the data parallelism or
the pipeline schedule.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from lmforge import IGNORE_INDEX
from lmforge.job import Job
from lmforge.config.rl import reward_names, reward_weights
from lmforge.models.grpo import GRPOParams
from lmforge.models.loss import micro_batch_loss_sum, token_loss_sum
from lmforge.models.sampling import Sampling
from lmforge.models.preference import NEEDS_REFERENCE, PreferenceParams
from lmforge.train.grpo import GRPO
from lmforge.train.rewards import load_rewards
from lmforge.train.preference import Preference


@dataclass(frozen=True)
class NextToken:
    """Cross-entropy of each next token, summed over the tokens that carry a label:
    every token of pretraining and text corpora; SFT's completion tokens (the prompt's
    labels are ``lmforge.IGNORE_INDEX``). The unit it counts is a labelled token."""
    name: str = "next_token"
    unit: str = "valid_tokens"  # what it counts, as metrics.jsonl names the count

    def count(self, batch: dict) -> int:
        return int((batch["labels"] != IGNORE_INDEX).sum())

    def prepare(self, tm, micro_batches: list[dict], step: int, device: torch.device,
                autocast=contextlib.nullcontext) -> tuple[list[dict], dict]:
        """The step's micro-batches as it trains on them, and metrics of making them:
        the data's own here (GRPO samples completions of its prompts: train/grpo.py)."""
        return micro_batches, {}

    def takes_new_batches(self, step: int) -> bool:
        """Whether step ``step`` reads new micro-batches (GRPO's may reuse its rollout)."""
        return True

    def loss_sum(self, model: nn.Module, batch: dict, device: torch.device,
                 autocast=contextlib.nullcontext, loss_chunk_tokens: int = 0,
                 stats: Optional[dict] = None) -> torch.Tensor:
        return micro_batch_loss_sum(model, batch, device, autocast, loss_chunk_tokens)

    def stage_loss_sum(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return token_loss_sum(logits, labels)

    def held_out(self, tm, batches, device: torch.device, autocast) -> dict:
        """``eval_loss`` (mean per token) and ``eval_tokens`` on any layout."""
        loss, tokens = tm.evaluate(batches, device, autocast)
        return {"eval_loss": loss, "eval_tokens": tokens}


NEXT_TOKEN = NextToken()


def objective_for(job: Job) -> "NextToken | Preference | GRPO":
    """The objective a job trains (``Job.objective`` names it): the next-token loss, a
    preference loss whose reference is the adapters-off model (LoRA), the pairs' stored
    log-probabilities (train.reference=precomputed) or a frozen copy, set by the caller
    (``Preference.reference_model``), or GRPO (its rewards loaded: a user's reward file
    runs here)."""
    if job.objective == NEXT_TOKEN.name:
        return NEXT_TOKEN
    if job.objective == "grpo":
        return grpo_objective(job)
    t = job.config.train
    params = PreferenceParams(beta=t.beta, label_smoothing=t.label_smoothing,
                              gamma=t.simpo_gamma, lam=t.orpo_lambda)
    reference = ("none" if job.objective not in NEEDS_REFERENCE else
                 "batch" if t.reference == "precomputed" else
                 "adapters_off" if job.config.lora.enabled else "model")
    return Preference(job.objective, params, reference)


def grpo_objective(job: Job) -> GRPO:
    """GRPO from the rl section; its reference (rl.beta > 0) is the adapters-off model
    (LoRA) or a frozen copy set by the caller (``GRPO.reference_model``)."""
    rl = job.config.rl
    names = reward_names(rl.rewards)
    rewards = load_rewards(names, reward_weights(rl.reward_weights, len(names)),
                           answer_field=rl.answer_field, format_pattern=rl.format_pattern,
                           max_completion_length=rl.max_completion_length)
    params = GRPOParams(beta=rl.beta, epsilon=rl.epsilon, epsilon_high=rl.epsilon_high,
                        loss_type=rl.loss_type, max_completion_length=rl.max_completion_length,
                        mask_truncated_completions=rl.mask_truncated_completions)
    reference = ("none" if not rl.beta else
                 "adapters_off" if job.config.lora.enabled else "model")
    return GRPO(params, rewards, rl.num_generations,
                Sampling(temperature=rl.temperature, top_p=rl.top_p), rl.scale_rewards,
                int(job.config.train.seed), reference, num_iterations=rl.num_iterations)
