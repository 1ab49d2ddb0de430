"""One optimizer step's worth of forward/backward, and evaluation.

The loss of a step is the sum of the token cross-entropies over all its micro-batches
divided by the number of valid (label != -100) tokens in the whole step, so it does not
depend on how the step is split into micro-batches or how padding falls.
"""
from __future__ import annotations

import contextlib
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of cross-entropies over valid tokens, computed in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def _plain(x: torch.Tensor) -> torch.Tensor:
    """A loss computed under tensor parallelism is a replicated DTensor; take its value."""
    return x.full_tensor() if hasattr(x, "full_tensor") else x


def count_valid_tokens(batches: Iterable[dict]) -> int:
    return int(sum((b["labels"] != IGNORE_INDEX).sum().item() for b in batches))


def model_inputs(batch: dict, device: torch.device) -> dict:
    inputs = {"tokens": batch["input_ids"].to(device, non_blocking=True)}
    for key in ("positions", "mask"):
        if batch.get(key) is not None:
            inputs[key] = batch[key].to(device, non_blocking=True)
    return inputs


def accumulate_gradients(model: nn.Module, micro_batches: list[dict], device: torch.device,
                         autocast=contextlib.nullcontext, n_valid: int | None = None,
                         grad_scale: float = 1.0) -> torch.Tensor:
    """Forward/backward over the micro-batches of one step; returns the step's loss.

    ``n_valid`` is the token count the loss is divided by: this step's valid tokens on
    every data-parallel rank together (the caller all-reduces it), else this rank's own.
    ``grad_scale`` multiplies what is back-propagated (not the returned loss), to undo a
    data-parallel wrapper's gradient averaging.
    """
    if n_valid is None:
        n_valid = count_valid_tokens(micro_batches)
    n_valid = max(n_valid, 1)  # a step of only padding contributes zero, not NaN
    loss_sum = torch.zeros((), device=device)
    for batch in micro_batches:
        with autocast():
            logits = model(**model_inputs(batch, device))  # (batch, seq, vocab)
        micro_loss = token_loss_sum(logits, batch["labels"].to(device))
        (micro_loss * (grad_scale / n_valid)).backward()
        loss_sum += _plain(micro_loss.detach())
    return loss_sum / n_valid


@torch.no_grad()
def evaluate(model: nn.Module, batches: Iterable[dict], device: torch.device,
             autocast=contextlib.nullcontext) -> tuple[float, int]:
    """Mean per-token loss over every valid token of ``batches``, and the token count."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    tokens = 0
    for batch in batches:
        with autocast():
            logits = model(**model_inputs(batch, device))
        total += _plain(token_loss_sum(logits, batch["labels"].to(device))).double()
        tokens += int((batch["labels"] != IGNORE_INDEX).sum())
    model.train(was_training)
    if tokens == 0:
        raise ValueError("evaluation data has no valid tokens")
    return float(total / tokens), tokens
