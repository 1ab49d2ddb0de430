"""What ``lmforge eval`` scores: any local source as a ``Dataset`` whose every token is a
target once, in order (the loader's ``held_out_batches`` reads it).

A Megatron prefix (or its .bin/.idx), a .txt file or text files (each as its tokenizer
encodes it, an EOD between files: one file scores as transformers scores its text), or a
.jsonl file of ``{json_key: text}`` records (documents followed by EOD) become windows of
``seq_len + 1`` tokens over their concatenation (``TokenWindows``, the last one padded);
a .jsonl file of SFT samples gives one padded row per sample, only the assistant tokens
scored.
"""
from __future__ import annotations

import itertools
from pathlib import Path
from typing import Iterable, Iterator, Optional

import numpy as np

from lmforge.data.dataset import RowDataset
from lmforge.data.errors import DataError
from lmforge.data.indexed import IndexedDataset
from lmforge.data.indexed_files import exists, strip_suffix
from lmforge.data.sft import iter_jsonl, record_messages
from lmforge.data.sft_rows import sft_row
from lmforge.data.templates import get_template
from lmforge.data.tokenizer import read_text
from lmforge.data.windows import TokenWindows


def eval_dataset(path, tokenizer, seq_len: int, cfg=None, json_key: Optional[str] = None):
    """Every token of ``path`` once (see the module doc). ``cfg``: the run's config
    (data.document_mask, data.template, data.json_key) or None; ``json_key``: the
    records' text field (default: data.json_key, else "text")."""
    document_mask = bool(cfg is not None and cfg.data.document_mask)
    pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else 0
    text = str(path)
    if exists(strip_suffix(text)):
        docs = IndexedDataset(strip_suffix(text))
    elif text.endswith((".jsonl", ".jsonl.gz")):
        key = json_key or (cfg.data.json_key if cfg is not None else "text")
        docs = _jsonl_documents(Path(text), cfg, tokenizer, key, seq_len)
        if isinstance(docs, RowDataset):
            return docs
    elif text.endswith(".txt") and Path(text).is_file():
        docs = list(text_documents([Path(text)], tokenizer))
    else:
        raise DataError(f"{path}: not a PREFIX.bin/.idx pair, a .jsonl or a .txt file")
    return TokenWindows(docs, seq_len, partial_last=True, document_mask=document_mask,
                        pad_id=pad_id)


def text_eval_dataset(files: list[Path], tokenizer, seq_len: int) -> TokenWindows:
    """Every token of the text ``files`` once, in order (see ``text_documents``)."""
    pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else 0
    return TokenWindows(list(text_documents(files, tokenizer)), seq_len, partial_last=True,
                        pad_id=pad_id)


def text_documents(files: Iterable[Path], tokenizer) -> Iterator[np.ndarray]:
    """Each file as its tokenizer encodes it (with the special tokens it adds), an EOD
    between files and none after the last: one file scores as transformers scores its
    text."""
    for n, path in enumerate(files):
        between = tokenizer.eos_ids if n else []
        yield np.asarray(between + tokenizer.encode(read_text(path)), dtype=np.int64)


class SFTSamples(RowDataset):
    """Encoded SFT samples, one padded row each, in order: ``lmforge eval`` on a chat
    file (only the samples with a scored token within ``seq_len + 1`` are kept)."""

    def __init__(self, samples: list[tuple[np.ndarray, np.ndarray]], seq_len: int,
                 pad_id: int):
        self.samples, self.seq_len, self.pad_id = samples, seq_len, pad_id

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def distinct_samples(self) -> int:
        return len(self.samples)

    def fingerprint(self) -> list:
        return [len(self.samples)]

    def __getitem__(self, k: int) -> dict:
        return sft_row([self.samples[k % len(self.samples)]], self.seq_len, self.pad_id,
                       packed=False)


def _jsonl_documents(path: Path, cfg, tokenizer, key: str, seq_len: int):
    """The text records' documents, or the chat records as ``SFTSamples``."""
    records = iter_jsonl(path)
    first = next(records, None)
    if first is None:
        raise DataError(f"{path}: no records")
    records = itertools.chain([first], records)
    if isinstance(first[1], dict) and key not in first[1] and \
            ("messages" in first[1] or "prompt" in first[1]):
        template = get_template(cfg.data.template if cfg is not None else "auto", tokenizer)
        samples = []
        for n, obj in records:
            where = f"{path}:{n}"
            ids, trained = template.encode(record_messages(obj, where), tokenizer, where)
            if trained[1:seq_len + 1].any():
                samples.append((ids, trained))
        return SFTSamples(samples, seq_len,
                          tokenizer.pad_id if tokenizer.pad_id is not None else 0)
    docs = []
    for n, obj in records:
        if not isinstance(obj, dict) or not isinstance(obj.get(key), str):
            raise DataError(f"{path}:{n}: no string key {key!r}")
        if obj[key].strip():
            docs.append(np.asarray(tokenizer.encode(obj[key]) + tokenizer.eos_ids))
    return docs
