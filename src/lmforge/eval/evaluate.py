"""Loss evaluation: the mean per-token loss of a model over batches (the trainer's eval
and ``lmforge eval``), and evaluation data from any local source as non-overlapping-target
windows, each token once.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterable, Iterator

import torch
from torch import nn

from lmforge.data.loader import iter_eval_batches, iter_text_eval_batches
from lmforge.data.tokenizer import Tokenizer, iter_text_files
from lmforge.models.loss import IGNORE_INDEX, micro_batch_loss_sum
from lmforge.parallel import full_value


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


def eval_batches_for(paths: list[str], tokenizer: Tokenizer, seq_len: int, batch_size: int,
                     json_key: str = "text") -> Iterator[dict]:
    """Text files or directories are tokenized here (each as the tokenizer encodes it, an
    EOD between files); JSONL files and preprocessed ``PREFIX`` (.bin/.idx) datasets go
    through the data pipeline."""
    if len(paths) == 1 and _is_structured(paths[0]):
        return iter_eval_batches(None, tokenizer, paths[0], seq_len, batch_size, json_key)
    files = list(iter_text_files(paths))
    if not files:
        raise FileNotFoundError(f"{', '.join(paths)}: no text files to evaluate on")
    return iter_text_eval_batches(files, tokenizer, seq_len, batch_size)


def _is_structured(path: str) -> bool:
    p = Path(path)
    return (p.suffix in (".jsonl", ".json", ".gz", ".parquet")
            or (Path(f"{path}.bin").is_file() and Path(f"{path}.idx").is_file()))
