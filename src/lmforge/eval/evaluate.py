"""Loss evaluation: the mean per-token loss of a model over batches (the trainer's eval
and ``lmforge eval``), and evaluation data from any local source as non-overlapping-target
windows, each token once.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

import torch
from torch import nn

from lmforge import IGNORE_INDEX
from lmforge.data.evalsets import eval_dataset, text_eval_dataset
from lmforge.data.loader import BatchLoader
from lmforge.data.tokenizer import Tokenizer, iter_text_files
from lmforge.models.loss import micro_batch_loss_sum
from lmforge.parallel import full_value


def evaluate(model: nn.Module, batches: Iterable[dict], device: torch.device,
             autocast=contextlib.nullcontext, loss_chunk_tokens: int = 0,
             on_batch: Optional[Callable[[int, float], None]] = None) -> tuple[float, int]:
    """Mean per-token loss over every valid token of ``batches``, and the token count.
    ``on_batch(tokens, mean loss)`` after each batch (for progress; it waits for the
    device, so only when asked)."""
    total, tokens = loss_sums(model, batches, device, autocast, loss_chunk_tokens, on_batch)
    return mean_loss(total, tokens)


@torch.no_grad()
def loss_sums(model: nn.Module, batches: Iterable[dict], device: torch.device,
              autocast=contextlib.nullcontext, loss_chunk_tokens: int = 0,
              on_batch: Optional[Callable[[int, float], None]] = None
              ) -> tuple[torch.Tensor, int]:
    """The sum of the token losses over ``batches`` (float64, on ``device``) and the count
    of valid tokens: what data-parallel ranks add up before dividing."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    tokens = 0
    for batch in batches:
        loss = micro_batch_loss_sum(model, batch, device, autocast, loss_chunk_tokens)
        total += full_value(loss).double()
        tokens += int((batch["labels"] != IGNORE_INDEX).sum())
        if on_batch is not None and tokens:
            on_batch(tokens, float(total / tokens))
    model.train(was_training)
    return total, tokens


def mean_loss(total: torch.Tensor, tokens: int) -> tuple[float, int]:
    if tokens == 0:
        raise ValueError("evaluation data has no valid tokens")
    return float(total / tokens), tokens


def limit_tokens(batches: Iterable[dict], max_tokens: Optional[int]) -> Iterator[dict]:
    """``batches`` until ``max_tokens`` targets (labels other than -100) are scored: the
    batch that crosses the budget keeps only its first targets (row by row), and none
    follows. ``None``: every batch."""
    if max_tokens is None:
        yield from batches
        return
    left = max_tokens
    for batch in batches:
        if left <= 0:
            return
        valid = batch["labels"] != IGNORE_INDEX
        n = int(valid.sum())
        if n > left:  # mask the targets past the budget
            keep = valid.flatten().cumsum(0).view_as(valid) <= left
            batch = {**batch, "labels": batch["labels"].masked_fill(~keep, IGNORE_INDEX)}
            n = left
        left -= n
        yield batch


def eval_batches_for(paths: list[str], tokenizer: Tokenizer, seq_len: int, batch_size: int,
                     json_key: str = "text") -> Iterator[dict]:
    """Text files or directories are tokenized here (each as the tokenizer encodes it, an
    EOD between files); JSONL files and preprocessed ``PREFIX`` (.bin/.idx) datasets go
    through the data pipeline; either way every token is a target once, in batches of
    ``batch_size`` windows (the last one smaller)."""
    if len(paths) == 1 and _is_structured(paths[0]):
        dataset = eval_dataset(paths[0], tokenizer, seq_len, json_key=json_key)
    else:
        files = list(iter_text_files(paths))
        if not files:
            raise FileNotFoundError(f"{', '.join(paths)}: no text files to evaluate on")
        dataset = text_eval_dataset(files, tokenizer, seq_len)
    return BatchLoader(dataset, batch_size).held_out_batches()


def _is_structured(path: str) -> bool:
    p = Path(path)
    return (p.suffix in (".jsonl", ".json", ".gz", ".parquet")
            or (Path(f"{path}.bin").is_file() and Path(f"{path}.idx").is_file()))
