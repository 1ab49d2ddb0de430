"""One optimizer step's worth of forward/backward.

The loss of a step is the sum of the token cross-entropies over all its micro-batches
divided by the number of valid (label != -100) tokens in the whole step, so it does not
depend on how the step is split into micro-batches or how padding falls.
"""
from __future__ import annotations

import contextlib
from typing import Iterable

import torch
from torch import nn

from lmforge.models.loss import IGNORE_INDEX, micro_batch_loss_sum
from lmforge.parallel import full_value


def count_valid_tokens(batches: Iterable[dict]) -> int:
    return int(sum((b["labels"] != IGNORE_INDEX).sum().item() for b in batches))


def accumulate_gradients(model: nn.Module, micro_batches: list[dict], device: torch.device,
                         autocast=contextlib.nullcontext, n_valid: int | None = None,
                         grad_scale: float = 1.0, loss_chunk_tokens: int = 0) -> torch.Tensor:
    """Forward/backward over the micro-batches of one step; returns the step's loss.

    ``n_valid`` is the token count the loss is divided by: this step's valid tokens on
    every data-parallel rank together (the caller all-reduces it), else this rank's own.
    ``grad_scale`` multiplies what is back-propagated (not the returned loss), to undo a
    data-parallel wrapper's gradient averaging. ``loss_chunk_tokens``: see
    ``chunked_loss_sum`` (0: the whole micro-batch's logits at once).
    """
    if n_valid is None:
        n_valid = count_valid_tokens(micro_batches)
    n_valid = max(n_valid, 1)  # a step of only padding contributes zero, not NaN
    loss_sum = torch.zeros((), device=device)
    for batch in micro_batches:
        micro_loss = micro_batch_loss_sum(model, batch, device, autocast, loss_chunk_tokens)
        (micro_loss * (grad_scale / n_valid)).backward()
        loss_sum += full_value(micro_loss)  # (a replicated DTensor under loss parallel)
    return loss_sum / n_valid
