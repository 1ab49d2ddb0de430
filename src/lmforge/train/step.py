"""One optimizer step's worth of forward/backward, and evaluation.

The loss of a step is the sum of the token cross-entropies over all its micro-batches
divided by the number of valid (label != -100) tokens in the whole step, so it does not
depend on how the step is split into micro-batches or how padding falls; every layout
normalises with ``normalize_loss``.
"""
from __future__ import annotations

import contextlib
from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lmforge.parallel import full_value
from lmforge.parallel.mesh import ParallelDims

IGNORE_INDEX = -100


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of cross-entropies over valid tokens, computed in fp32."""
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_loss_sum(output: nn.Module, hidden: torch.Tensor, labels: torch.Tensor,
                     chunk_tokens: int, autocast=contextlib.nullcontext) -> torch.Tensor:
    """``token_loss_sum(output(hidden), labels)`` without the whole micro-batch's logits.

    The output layer and the loss run on ``chunk_tokens`` tokens at a time, each chunk
    under activation checkpointing: only the chunk's hidden states are kept for backward,
    and its logits (and their fp32 copy and softmax) are recomputed there, one chunk at a
    time. With a large vocabulary those tensors are the biggest of the step (Llama 3:
    128,256 logits per token, 0.5 MiB in fp32); the price is a second output matmul.
    """
    hidden, labels = hidden.flatten(0, -2), labels.flatten()

    def chunk_loss(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with autocast():
            logits = output(h)
        return token_loss_sum(logits, y)

    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk_tokens):
        end = start + chunk_tokens
        if not torch.is_grad_enabled():
            total = total + chunk_loss(hidden[start:end], labels[start:end])
            continue
        total = total + checkpoint(chunk_loss, hidden[start:end], labels[start:end],
                                   use_reentrant=False)
    return total


def micro_batch_loss_sum(model: nn.Module, batch: dict, device: torch.device,
                         autocast=contextlib.nullcontext, loss_chunk_tokens: int = 0
                         ) -> torch.Tensor:
    """Forward one micro-batch and return the sum of its valid tokens' losses."""
    labels = batch["labels"].to(device)
    if loss_chunk_tokens:
        with autocast():
            hidden = model(**model_inputs(batch, device), head=False)  # (batch, seq, dim)
        return chunked_loss_sum(model.output, hidden, labels, loss_chunk_tokens, autocast)
    with autocast():
        logits = model(**model_inputs(batch, device))  # (batch, seq, vocab)
    return token_loss_sum(logits, labels)


def normalize_loss(loss_sum: torch.Tensor, n_valid: int, dp: int = 1) -> torch.Tensor:
    """``loss_sum`` (a sum of token cross-entropies) as its share of the step loss

        loss = (sum of the token cross-entropies of the step) / N,

    N = the step's valid (label != -100) tokens on all data-parallel ranks together
    (``global_valid_tokens``; at least 1, so a step of only padding gives 0, not NaN).
    What is back-propagated is ``loss_sum * dp / N`` in every layout:

    - gradient accumulation: each micro-batch's sum is divided by the whole step's N, not
      by its own count, so splitting a step into micro-batches changes nothing;
    - data parallel (DDP, FSDP2, HSDP): each rank holds its own micro-batches' sums, and
      the wrapper averages gradients over the dp ranks, so ``x dp`` turns that average
      into the sum the formula needs (``dp=1``: the plain value, as logged);
    - tensor / sequence parallel: the tp ranks of a data-parallel group load the same
      batch and, under ``loss_parallel``, each holds the whole (replicated) loss sum, so
      they back-propagate the same value and N counts that batch once;
    - pipeline parallel: the schedule calls this for each pipeline microbatch on the last
      stage, with the step's N, and does not rescale gradients (``scale_grads=False``).
    """
    return loss_sum * (dp / max(n_valid, 1))


def count_valid_tokens(batches: Iterable[dict]) -> int:
    return int(sum((b["labels"] != IGNORE_INDEX).sum().item() for b in batches))


def global_valid_tokens(local: int, dims: ParallelDims, device: torch.device) -> int:
    """N of ``normalize_loss``: the step's valid tokens on all data-parallel ranks. Every
    tp and pp rank of a data-parallel group loads the same batch, so the world sum counts
    each tp x pp times."""
    if dims.mesh is None:
        return local
    total = torch.tensor(local, dtype=torch.int64, device=device)
    dist.all_reduce(total)
    return int(total) // (dims.tp * dims.pp)


def global_step_loss(local: torch.Tensor, dims: ParallelDims) -> torch.Tensor:
    """The step loss, the same on every rank, from each rank's ``normalize_loss`` share
    (dp=1): tp ranks hold copies, and only last pipeline stages hold any."""
    if dims.mesh is None:
        return local
    total = local.detach().clone().float()
    dist.all_reduce(total)
    return total / dims.tp


def model_inputs(batch: dict, device: torch.device) -> dict:
    inputs = {"tokens": batch["input_ids"].to(device, non_blocking=True)}
    for key in ("positions", "mask"):
        if batch.get(key) is not None:
            inputs[key] = batch[key].to(device, non_blocking=True)
    return inputs


def accumulate_gradients(model: nn.Module, micro_batches: list[dict], device: torch.device,
                         autocast=contextlib.nullcontext, n_valid: int | None = None,
                         dp: int = 1, loss_chunk_tokens: int = 0) -> torch.Tensor:
    """Forward/backward over the micro-batches of one step; returns this rank's share of
    the step loss. ``n_valid``, ``dp``: see ``normalize_loss`` (default: this rank's own
    valid tokens, one process). ``loss_chunk_tokens``: see ``chunked_loss_sum`` (0: the
    whole micro-batch's logits at once).
    """
    if n_valid is None:
        n_valid = count_valid_tokens(micro_batches)
    loss_sum = torch.zeros((), device=device)
    for batch in micro_batches:
        micro_loss = micro_batch_loss_sum(model, batch, device, autocast, loss_chunk_tokens)
        normalize_loss(micro_loss, n_valid, dp).backward()
        loss_sum += full_value(micro_loss)  # (a replicated DTensor under loss parallel)
    return normalize_loss(loss_sum, n_valid)


@torch.no_grad()
def evaluate(model: nn.Module, batches: Iterable[dict], device: torch.device,
             autocast=contextlib.nullcontext, loss_chunk_tokens: int = 0) -> tuple[float, int]:
    """Mean per-token loss over every valid token of ``batches``, and the token count."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    tokens = 0
    for batch in batches:
        loss = micro_batch_loss_sum(model, batch, device, autocast, loss_chunk_tokens)
        total += full_value(loss).double()
        tokens += int((batch["labels"] != IGNORE_INDEX).sum())
    model.train(was_training)
    if tokens == 0:
        raise ValueError("evaluation data has no valid tokens")
    return float(total / tokens), tokens
