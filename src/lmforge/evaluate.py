"""Evaluation data: any local source -> non-overlapping-target windows, each token once."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

from lmforge.data.loader import iter_eval_batches, iter_text_eval_batches
from lmforge.data.tokenizer import Tokenizer, iter_text_files


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
