"""Plain-text corpora tokenized in memory: the Python standard library (the CPU demo's
corpus, present on every machine with Python) and local files.

A corpus is read as ``lmforge tokenizer train`` and ``preprocess`` read their inputs (one
path for data, ``corpus_documents``): a JSON Lines, JSON array or parquet file gives the
text under ``data.json_key`` of each record (a bad record is refused with ``file:line``),
any other file its whole text (bytes that are not UTF-8 are refused with the file, line and
byte offset). Blank documents are left out; a corpus of none but blank ones is refused.

Their batches are ``windows.TokenWindows`` under the one loader (see ``build``). For
corpora larger than memory, preprocess them into an indexed dataset instead
(``lmforge preprocess``, ``data.kind: pretrain``).
"""
from __future__ import annotations

import sysconfig
import zlib
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from lmforge.data.errors import DataError
from lmforge.data.tokenizer import CORPUS_SUFFIXES, Tokenizer, iter_text_files, training_texts

# The demo reads this much of the standard library: enough text for a few hundred steps,
# small enough to tokenize in seconds on a laptop.
STDLIB_CHAR_BUDGET = 4_000_000
_STDLIB_SKIP = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3",
                "__pycache__", "turtledemo", "ensurepip", "pydoc_data", "config-3"}


def stdlib_files(char_budget: int = STDLIB_CHAR_BUDGET) -> list[Path]:
    """The running interpreter's standard-library ``.py`` files, sorted, up to a size
    budget. The same Python version gives the same list on every machine."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if any(part in _STDLIB_SKIP or part.startswith("config-") for part in rel[:-1]):
            continue
        size = path.stat().st_size
        if total + size > char_budget:
            continue
        files.append(path)
        total += size
    if not files:
        raise FileNotFoundError(f"{root}: no standard-library sources found")
    return files


def split_files(files: list[Path], eval_fraction: float) -> tuple[list[Path], list[Path]]:
    """Deterministic train/held-out split by a hash of the file name. A corpus whose every
    file hashes into the held-out share (one file, say) holds none out: training needs the
    text, and ``split_tokens`` then holds out the tail of its tokens instead."""
    if eval_fraction <= 0:
        return files, []
    cut = int(eval_fraction * 10_000)
    held = [f for f in files if zlib.crc32(f.name.encode()) % 10_000 < cut]
    if len(held) == len(files):
        return files, []
    train = [f for f in files if f not in set(held)]
    return train, held


def split_tokens(tokens: np.ndarray, eval_fraction: float, seq_len: int,
                 min_train_windows: int) -> tuple[np.ndarray, np.ndarray]:
    """The last ``eval_fraction`` of the tokens (at least one window of ``seq_len + 1``)
    held out, for a corpus with too few files to hold out whole ones. Nothing is held out
    when that would leave fewer than ``min_train_windows`` windows to train on."""
    held = max(int(len(tokens) * eval_fraction), seq_len + 1)
    if eval_fraction <= 0 or (len(tokens) - held - 1) // seq_len < min_train_windows:
        return tokens, tokens[:0]
    return tokens[:-held], tokens[-held:]


def corpus_files(kind: str, path, eval_path, eval_fraction: float
                 ) -> tuple[list[Path], list[Path]]:
    if kind == "stdlib":
        return split_files(stdlib_files(), eval_fraction)
    files = listed_files(path)
    if eval_path:
        return files, listed_files(eval_path)
    return split_files(files, eval_fraction)


def listed_files(path) -> list[Path]:
    """The files of ``path`` (a path or a list of them; directories walked in sorted order
    for the corpus suffixes)."""
    paths = path if isinstance(path, list) else [path]
    files = list(iter_text_files(paths, CORPUS_SUFFIXES))
    if not files:
        raise FileNotFoundError(f"{', '.join(map(str, paths))}: no "
                                f"{'/'.join(CORPUS_SUFFIXES)} files")
    return files


def corpus_documents(files: Iterable[Path], json_key: str = "text") -> Iterator[str]:
    """The documents of ``files`` that hold text (see the module doc)."""
    return training_texts(files, [json_key])


def check_corpus(field: str, path, json_key: str) -> None:
    """Reads every document of the corpus at ``path`` (config field ``field``), refusing a
    bad record or file, or a corpus with no text at all, with the field first."""
    try:
        found = sum(1 for _ in corpus_documents(listed_files(path), json_key))
    except (ValueError, OSError) as e:
        raise DataError(f"{field}: {' '.join(str(e).split())}") from None
    if not found:
        raise DataError(f"{field}: {path}: no text to train on (every file, or every "
                        f"record's {json_key!r}, is empty)")


def tokenize_files(files: Iterable[Path], tokenizer: Tokenizer, json_key: str = "text"
                   ) -> np.ndarray:
    """All documents concatenated, each as the tokenizer encodes it (with the special
    tokens it adds itself) and followed by the end-of-document token."""
    texts = list(corpus_documents(files, json_key))
    pieces = [np.asarray(ids + tokenizer.eos_ids, dtype=np.int32)
              for ids in tokenizer.encode_batch(texts)]
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)
