"""One entry point from the data config to the loaders the trainer pulls batches from."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

from lmforge.config import JobConfig
from lmforge.data.loader import build_dataset_loader
from lmforge.data.text import PackedTokenLoader, corpus_files, split_tokens, tokenize_files
from lmforge.data.tokenizer import Tokenizer, read_text, train_bpe


@dataclass
class DataBundle:
    # has next_batch(), consumed_samples, state_dict() / load_state_dict() (loader_state)
    train: object
    eval_batches: Optional[Callable[[], Iterator[dict]]]  # a fresh pass over held-out data
    description: str
    notes: list[str] = field(default_factory=list)  # lines the run prints at start
    stats: dict = field(default_factory=dict)  # counts the run records in summary.json


def corpus_texts_for_tokenizer(cfg: JobConfig) -> Iterator[str]:
    """The training texts, for training a tokenizer when the run has none."""
    train_files, _ = corpus_files(cfg.data.kind, cfg.data.path, cfg.data.eval_path,
                                  cfg.data.eval_fraction)
    return (read_text(f) for f in train_files)


def train_corpus_tokenizer(cfg: JobConfig) -> Tokenizer:
    if cfg.data.kind not in ("stdlib", "text"):
        raise ValueError("model.tokenizer: required for data.kind "
                         f"{cfg.data.kind} (only raw-text corpora can train one)")
    return train_bpe(corpus_texts_for_tokenizer(cfg), cfg.data.tokenizer_vocab_size)


def build_data(cfg: JobConfig, tokenizer: Tokenizer, dp_rank: int = 0, dp_size: int = 1,
               cache_dir: Optional[Path] = None) -> DataBundle:
    d = cfg.data
    if d.kind in ("stdlib", "text"):
        return _build_text(cfg, tokenizer, dp_rank, dp_size)
    train = build_dataset_loader(cfg, tokenizer, dp_rank, dp_size, "train", cache_dir)
    eval_batches = None
    if d.eval_path:
        eval_batches = lambda: _limited(  # noqa: E731
            build_dataset_loader(cfg, tokenizer, dp_rank, dp_size, "eval", cache_dir),
            cfg.train.eval_batches)
    description = f"{d.kind} data from {d.path}"
    template = getattr(train.dataset, "template", None)
    if template is not None:  # say which template renders the samples (auto may fall back)
        description += f", chat template {template.name}" + (
            " (the model's own)" if d.template == "auto" and template.source else "")
    if d.kind == "sft":
        return DataBundle(train, eval_batches, description, *_sft_truncation(train.dataset))
    return DataBundle(train, eval_batches, description)


def _sft_truncation(dataset) -> tuple[list[str], dict]:
    """The note and counts of the training samples cut to seq_len + 1 tokens."""
    n, lost = dataset.truncated_samples, dataset.truncated_tokens
    stats = {"sft_truncated_samples": n, "sft_truncated_tokens": lost,
             "sft_dropped_samples": dataset.dropped}
    if not n:
        return [], stats
    note = (f"SFT data: {n:,} of {dataset.num_samples:,} samples are longer than seq_len + "
            f"1 = {dataset.seq_len + 1} tokens and were cut to fit ({lost:,} tokens lost); "
            f"raise data.seq_len to keep them")
    return [note], stats


def _build_text(cfg, tokenizer, dp_rank, dp_size) -> DataBundle:
    d = cfg.data
    train_files, eval_files = corpus_files(d.kind, d.path, d.eval_path, d.eval_fraction)
    train_tokens = tokenize_files(train_files, tokenizer)
    if eval_files:
        eval_tokens, held = tokenize_files(eval_files, tokenizer), f"{len(eval_files)} files"
    elif d.eval_path:
        eval_tokens, held = train_tokens[:0], "0 files"
    else:  # too few files to hold whole ones out: hold out the tail of the tokens
        train_tokens, eval_tokens = split_tokens(train_tokens, d.eval_fraction, d.seq_len,
                                                 d.micro_batch_size * dp_size)
        held = f"the last {len(eval_tokens):,} tokens"
    train = PackedTokenLoader(train_tokens, d.seq_len, d.micro_batch_size, cfg.train.seed,
                              dp_rank, dp_size)
    eval_batches = None
    if (len(eval_tokens) - 1) // d.seq_len >= 1:
        def eval_batches():
            loader = PackedTokenLoader(eval_tokens, d.seq_len, 1, 0, shuffle=False)
            loader.micro_batch_size = d.micro_batch_size
            return _limited_iter(loader.iter_once(), cfg.train.eval_batches)
    where = "the Python standard library" if d.kind == "stdlib" else str(d.path)
    desc = (f"{len(train_files)} files from {where}: {len(train_tokens):,} training tokens, "
            f"{held} held out")
    return DataBundle(train, eval_batches, desc)


def _limited_iter(it, n):
    for i, batch in enumerate(it):
        if i >= n:
            return
        yield batch


def _limited(loader, n):
    for _ in range(n):
        yield loader.next_batch()
