"""The language-model loss of a batch: the sum of token cross-entropies over the tokens
that have a target. Training (``train/step.py``, which divides by the step's global token
count) and evaluation (``eval/evaluate.py``) both compute it here, so they agree.

A batch is the data pipeline's dict: ``input_ids`` and ``labels`` (batch, seq), with
``IGNORE_INDEX`` where a position has no target, and optional ``positions`` / ``mask``.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lmforge import IGNORE_INDEX
from lmforge.models.attention import DocumentMask
from lmforge.models.fused_loss import FUSED_CHUNK_TOKENS, fused_loss_sum, fused_token_logps


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
    """Forward one micro-batch and return the sum of its valid tokens' losses: from the
    fused head (train.fused_loss, ``fused_head``), chunked, or from the whole logits."""
    labels = batch["labels"].to(device)
    if fused_head(model):
        with autocast():
            hidden = model(**model_inputs(batch, device), head=False)  # (batch, seq, dim)
        return fused_loss_sum(model.output, hidden, labels,
                              loss_chunk_tokens or FUSED_CHUNK_TOKENS, autocast)
    if loss_chunk_tokens:
        with autocast():
            hidden = model(**model_inputs(batch, device), head=False)  # (batch, seq, dim)
        return chunked_loss_sum(model.output, hidden, labels, loss_chunk_tokens, autocast)
    with autocast():
        logits = model(**model_inputs(batch, device))  # (batch, seq, vocab)
    return token_loss_sum(logits, labels)


def fused_head(model: nn.Module) -> bool:
    """train.fused_loss, set on the model by the trainer (``build_train_model``): its
    output layer and loss run as one fused, chunked function (``models/fused_loss.py``)."""
    return bool(getattr(model, "fused_loss", False))


def fused_label_logps(model: nn.Module, batch: dict, device: torch.device, autocast,
                      temperature: float, chunk_tokens: int = 0
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO's (log-probability of each label, entropy at its position) under the logits
    / ``temperature`` (``train.grpo.label_logps``), from the fused head: no logits kept."""
    with autocast():
        hidden = model(**model_inputs(batch, device), head=False)  # (batch, seq, dim)
    return fused_token_logps(model.output, hidden, batch["labels"].to(device),
                             chunk_tokens or FUSED_CHUNK_TOKENS, autocast,
                             scale=1.0 / temperature, entropy=True)


def model_inputs(batch: dict, device: torch.device) -> dict:
    """The model's arguments from a batch: its tokens, positions, and its documents
    (``segments``) as a ``DocumentMask``, or its ``ContextParallel`` part of each
    sequence (or an explicit boolean ``mask``)."""
    inputs = {"tokens": batch["input_ids"].to(device, non_blocking=True)}
    for key in ("positions", "mask"):
        if batch.get(key) is not None:
            inputs[key] = batch[key].to(device, non_blocking=True)
    if batch.get("segments") is not None:
        inputs["mask"] = DocumentMask(batch["segments"].to(device, non_blocking=True))
    if batch.get("context") is not None:  # this rank's part of each sequence (parallel.cp)
        inputs["mask"] = batch["context"].to(device, non_blocking=True)
    return inputs
