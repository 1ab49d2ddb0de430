"""Evaluation data: any local source -> non-overlapping-target windows, each token once."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

from lmforge.data.text import text_windows_for_eval, tokenize_files
from lmforge.data.tokenizer import Tokenizer, iter_text_files


def eval_batches_for(paths: list[str], tokenizer: Tokenizer, seq_len: int, batch_size: int,
                     json_key: str = "text") -> Iterator[dict]:
    """Text files or directories are tokenized here (documents joined by EOS); JSONL files
    and preprocessed ``PREFIX`` (.bin/.idx) datasets go through the data pipeline."""
    if len(paths) == 1 and _is_structured(paths[0]):
        from lmforge.data.loader import iter_eval_batches

        return iter_eval_batches(None, tokenizer, paths[0], seq_len, batch_size)
    files = list(iter_text_files(paths))
    if not files:
        raise FileNotFoundError(f"{', '.join(paths)}: no text files to evaluate on")
    tokens = tokenize_files(files, tokenizer)
    if len(tokens) < seq_len + 1:
        raise ValueError(f"{', '.join(paths)}: {len(tokens)} tokens, fewer than one window "
                         f"of --seq-len {seq_len}")
    return text_windows_for_eval(tokens, seq_len, batch_size)


def _is_structured(path: str) -> bool:
    p = Path(path)
    return (p.suffix in (".jsonl", ".json", ".gz", ".parquet")
            or (Path(f"{path}.bin").is_file() and Path(f"{path}.idx").is_file()))
