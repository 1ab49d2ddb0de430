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

import torch
from torch import nn

from lmforge.job import Job
from lmforge.models.loss import micro_batch_loss_sum, token_loss_sum


@dataclass(frozen=True)
class NextToken:
    """Cross-entropy of each next token, summed over the tokens that carry a label:
    every token of pretraining and text corpora; SFT's completion tokens (the prompt's
    labels are ``lmforge.IGNORE_INDEX``). The unit it counts is a labelled token."""
    name: str = "next_token"

    def loss_sum(self, model: nn.Module, batch: dict, device: torch.device,
                 autocast=contextlib.nullcontext, loss_chunk_tokens: int = 0) -> torch.Tensor:
        return micro_batch_loss_sum(model, batch, device, autocast, loss_chunk_tokens)

    def stage_loss_sum(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return token_loss_sum(logits, labels)


NEXT_TOKEN = NextToken()
# Every data kind (stdlib, text, pretrain, sft) trains the next-token objective today;
# preference pairs will bring their own, chosen by the data kind and train.objective.
OBJECTIVES = {NEXT_TOKEN.name: NEXT_TOKEN}


def objective_for(job: Job) -> NextToken:
    """The objective a job trains (``Job.objective`` names it)."""
    return OBJECTIVES[job.objective]
