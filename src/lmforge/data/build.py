"""One entry point from the data config to the loaders the trainer pulls batches from."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

from lmforge.config import ConfigError, JobConfig
from lmforge.config.rl import reward_names
from lmforge.data.errors import DataError
from lmforge.data.indexed import IndexedDataset
from lmforge.data.loader import BatchLoader, build_dataset_loader, pretrain_sources
from lmforge.data.preference import check_some_pair
from lmforge.data.prompts import check_prompts
from lmforge.data.sft import check_some_answer
from lmforge.data.text import (check_corpus, corpus_documents, corpus_files, split_tokens,
                               tokenize_files)
from lmforge.data.tokenizer import Tokenizer, train_bpe
from lmforge.data.windows import TokenWindows


@dataclass
class DataBundle:
    train: BatchLoader  # next_batch(), consumed_samples, state_dict() / load_state_dict()
    eval_batches: Optional[Callable[[], Iterator[dict]]]  # a fresh pass over held-out data
    description: str
    # What the held-out data is ("3 files (990 tokens)"), or why there is none.
    eval_note: str = ""
    notes: list[str] = field(default_factory=list)  # lines the run prints at start
    stats: dict = field(default_factory=dict)  # counts the run records in summary.json
    held_out: Optional[BatchLoader] = None  # the held-out loader of a dataset kind


def check_data(cfg: JobConfig) -> None:
    """What the data refuses before a run sets anything up (``train`` checks it before it
    claims its output directory, so a refusal writes nothing). A text corpus is read once
    here, whole: a bad record, a file that is not UTF-8 or a corpus without text is
    refused naming the field and the file (and line). An SFT file is read up to its first
    record with an answer; pretraining prefixes are opened (their index checks)."""
    d = cfg.data
    check = {"text": lambda field, path: check_corpus(field, path, d.json_key),
             "sft": check_some_answer, "pretrain": _open_prefixes,
             "preference": check_some_pair,
             "prompts": lambda field, path: check_prompts(field, path,
                                                          _answer_field(cfg))}.get(d.kind)
    if check is None:
        return
    if d.kind == "pretrain" and d.blend:
        check("data.blend", d.blend)
    else:
        check("data.path", d.path)
    if d.eval_path:
        check("data.eval_path", d.eval_path)


def _answer_field(cfg: JobConfig) -> Optional[str]:
    """rl.answer_field where the exact_answer reward reads it (else None)."""
    rewards = cfg.rl.rewards
    names = reward_names(rewards) if rewards is not None else []
    return cfg.rl.answer_field if "exact_answer" in names else None


def _open_prefixes(field: str, value) -> None:
    for _, prefix in pretrain_sources(value, field):
        IndexedDataset(prefix)


def corpus_texts_for_tokenizer(cfg: JobConfig) -> Iterator[str]:
    """The training texts, for training a tokenizer when the run has none."""
    train_files, _ = corpus_files(cfg.data.kind, cfg.data.path, cfg.data.eval_path,
                                  cfg.data.eval_fraction)
    return corpus_documents(train_files, cfg.data.json_key)


def check_tokenizer_source(cfg: JobConfig) -> None:
    """Refuses a run that names no tokenizer (model.tokenizer or model.init_from) when its
    data cannot train one: before anything is trained, the dry run too."""
    if not (cfg.model.tokenizer or cfg.model.init_from) and cfg.data.kind not in (
            "stdlib", "text"):
        raise ConfigError(f"model.tokenizer: required for data.kind {cfg.data.kind} "
                          f"(only raw-text corpora can train one)")


def train_corpus_tokenizer(cfg: JobConfig) -> Tokenizer:
    check_tokenizer_source(cfg)
    return train_bpe(corpus_texts_for_tokenizer(cfg), cfg.data.tokenizer_vocab_size)


def build_data(cfg: JobConfig, tokenizer: Tokenizer, dp_rank: int = 0, dp_size: int = 1,
               cache_dir: Optional[Path] = None) -> DataBundle:
    d = cfg.data
    if d.kind in ("stdlib", "text"):
        return _build_text(cfg, tokenizer, dp_rank, dp_size)
    train, held_out, eval_note = _dataset_loaders(cfg, tokenizer, dp_rank, dp_size, cache_dir)
    eval_batches = None if held_out is None else _passes(held_out, cfg.train.eval_batches)
    description = f"{d.kind} data from {d.path}"
    template = getattr(train.dataset, "template", None)
    if template is not None:  # say which template renders the samples (auto may fall back)
        description += f", chat template {template.name}" + (
            " (the model's own)" if d.template == "auto" and template.source else "")
    notes, stats = (_sft_counts(train.dataset) if d.kind == "sft" else
                    train.dataset.report() if d.kind == "preference" else ([], {}))
    if d.kind == "sft":
        note, stats["sft_padding_share"] = _sft_padding(cfg, train)
        notes.append(note)
    return DataBundle(train, eval_batches, description, eval_note, notes, stats, held_out)


def _passes(loader: BatchLoader, n: int) -> Callable[[], Iterator[dict]]:
    """Fresh passes over this rank's share of the first ``n`` batches of held-out samples
    per rank (the same ones each time; see ``BatchLoader.held_out_batches``)."""
    return lambda: loader.held_out_batches(n)


def _dataset_loaders(cfg, tokenizer, dp_rank, dp_size, cache_dir
                     ) -> tuple[BatchLoader, Optional[BatchLoader], str]:
    """(train loader, held-out loader or None, what is held out or why nothing is).
    Without data.eval_path, data.eval_fraction of the documents (pretrain) or of the
    samples (sft) is held out, unless too few to leave a training batch."""
    d = cfg.data

    def loader(split, holdout=False):
        return build_dataset_loader(cfg, tokenizer, dp_rank, dp_size, split, cache_dir,
                                    holdout)

    if d.eval_path:
        return loader("train"), loader("eval"), f"{d.eval_path} (data.eval_path)"
    if d.eval_fraction <= 0:
        return loader("train"), None, "data.eval_fraction=0 and no data.eval_path"
    try:
        held_out = loader("eval", holdout=True)
        train = loader("train", holdout=True)
        _keeps_a_micro_batch(train.dataset, d)
    except DataError as e:  # too small to split; the whole corpus trains
        return loader("train"), None, f"nothing held out ({e}); set data.eval_path"
    return train, held_out, _held_out_note(d, held_out.dataset)


def _keeps_a_micro_batch(train_dataset, d) -> None:
    """SFT: the training part must fill one micro-batch with distinct samples (a
    pretraining part keeps a window at least, checked by PretrainDataset)."""
    if d.kind in ("sft", "preference", "prompts") \
            and train_dataset.num_samples < d.micro_batch_size:
        raise DataError(f"{d.path}: {train_dataset.num_samples} training samples would be "
                        f"left by data.eval_fraction={d.eval_fraction}, fewer than "
                        f"data.micro_batch_size={d.micro_batch_size}")


def _held_out_note(d, dataset) -> str:
    """"12 documents (3,456 tokens) of PATH (data.eval_fraction=0.05)"."""
    if d.kind in ("sft", "preference", "prompts"):
        unit = {"sft": "samples", "preference": "pairs"}.get(d.kind, d.kind)
        count, tokens, source = dataset.num_samples, dataset.num_tokens, d.path
    else:
        parts = getattr(dataset, "datasets", [dataset])  # a blend, or one dataset
        count, unit = sum(len(p.lengths) for p in parts), "documents"
        tokens, source = sum(p.num_tokens for p in parts), d.blend or d.path
    return (f"{count:,} {unit} ({tokens:,} tokens) of {source} "
            f"(data.eval_fraction={d.eval_fraction})")


def _sft_counts(dataset) -> tuple[list[str], dict]:
    """The notes and counts of the training samples cut to seq_len + 1 tokens, and of
    the records skipped for an empty answer."""
    n, lost, empty = dataset.truncated_samples, dataset.truncated_tokens, dataset.empty_answers
    stats = {"sft_truncated_samples": n, "sft_truncated_tokens": lost,
             "sft_dropped_samples": dataset.dropped, "sft_empty_answer_samples": empty}
    notes = []
    if n:
        notes.append(f"SFT data: {n:,} of {dataset.num_samples:,} samples are longer than "
                     f"seq_len + 1 = {dataset.seq_len + 1} tokens and were cut to fit "
                     f"({lost:,} tokens lost); raise data.seq_len to keep them")
    if empty:
        records = dataset.num_samples + dataset.dropped + empty
        notes.append(f"SFT data: {empty:,} of {records:,} records have an empty assistant "
                     f"answer and were skipped (nothing to learn but the end of the turn)")
    return notes, stats


def _sft_padding(cfg: JobConfig, loader: BatchLoader) -> tuple[str, float]:
    """The start-up line saying how much of the SFT batches is padding (over the first
    epoch, as each rank's micro-batches hold it), and that share."""
    ds = loader.dataset
    share = ds.padding_share(loader.sampler.micro_batch_size)
    line = f"SFT: {ds.num_samples:,} samples, padding {share:.0%} of the positions"
    if ds.pack:
        return (f"{line} ({ds.rows_in_epoch(0):,} rows of data.seq_len = {ds.seq_len} "
                f"packed with samples, data.pack=true)"), share
    if ds.pad_to_multiple_of:
        how = (f"each batch padded to its longest sample, rounded up to a multiple of "
               f"{ds.pad_to_multiple_of} (data.pad_to_multiple_of)")
        if ds.group_size:
            how += ", samples of similar length batched together (data.group_by_length)"
    else:
        how = ("every batch padded to data.seq_len: pipeline parallelism needs one shape"
               if cfg.parallel.pp > 1 else
               "every batch padded to data.seq_len, data.pad_to_multiple_of=0")
        if ds.group_size:  # the order is kept, so a resume on another layout reads alike
            how += ", so data.group_by_length orders the samples but saves nothing"
    return f"{line} ({how}{_padding_advice(cfg, ds, share)})", share


def _padding_advice(cfg: JobConfig, ds, share: float) -> str:
    """What would remove more padding: grouping by length where batches are padded to
    their longest and much is padding, packing where pipeline parallelism allows it."""
    if cfg.parallel.pp > 1:
        return ""  # pipeline parallelism takes neither packing nor shorter batches
    if share > 0.15 and ds.pad_to_multiple_of and not ds.group_size:
        return ("; data.group_by_length=true batches samples of similar length, "
                "data.pack=true packs them")
    return "; data.pack=true packs samples instead"


def _build_text(cfg, tokenizer, dp_rank, dp_size) -> DataBundle:
    d = cfg.data
    train_files, eval_files = corpus_files(d.kind, d.path, d.eval_path, d.eval_fraction)
    train_tokens = tokenize_files(train_files, tokenizer, d.json_key)
    if eval_files:
        eval_tokens, held = (tokenize_files(eval_files, tokenizer, d.json_key),
                             f"{len(eval_files)} files")
    elif d.eval_path:
        eval_tokens, held = train_tokens[:0], "0 files"
    else:  # too few files to hold whole ones out: hold out the tail of the tokens
        train_tokens, eval_tokens = split_tokens(train_tokens, d.eval_fraction, d.seq_len,
                                                 d.micro_batch_size * dp_size)
        held = f"the last {len(eval_tokens):,} tokens"
    seed, per_step = cfg.train.seed, d.micro_batch_size * dp_size
    train = BatchLoader(TokenWindows([train_tokens], d.seq_len, seed, per_step),
                        d.micro_batch_size, dp_rank, dp_size, seed)
    eval_batches = None
    if (len(eval_tokens) - 1) // d.seq_len >= 1:
        held_out = BatchLoader(TokenWindows([eval_tokens], d.seq_len), d.micro_batch_size,
                               dp_rank, dp_size)
        eval_batches = _passes(held_out, cfg.train.eval_batches)
    where = "the Python standard library" if d.kind == "stdlib" else str(d.path)
    desc = (f"{len(train_files)} files from {where}: {len(train_tokens):,} training tokens, "
            f"{held} held out")
    return DataBundle(train, eval_batches, desc,
                      _text_eval_note(d, held, len(eval_tokens), eval_batches is not None))


def _text_eval_note(d, held: str, eval_tokens: int, usable: bool) -> str:
    if usable:  # held: "3 files" or "the last 1,234 tokens"
        return held + ("" if held.endswith("tokens") else f" ({eval_tokens:,} tokens)")
    if d.eval_path:
        return f"data.eval_path {d.eval_path} gives {eval_tokens:,} tokens, fewer than " \
               f"one window of data.seq_len + 1 = {d.seq_len + 1}"
    if d.eval_fraction <= 0:
        return "data.eval_fraction=0 and no data.eval_path"
    return (f"the corpus is too small to hold out data.eval_fraction={d.eval_fraction} of "
            f"it (a window of data.seq_len + 1 = {d.seq_len + 1} tokens at least) and keep "
            f"a batch to train on; set data.eval_path")
