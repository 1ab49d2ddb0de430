"""Shared fixtures for the data tests: generated text and a tiny BPE tokenizer."""
from __future__ import annotations

import json
import random
import warnings
from pathlib import Path

import pytest
import torch

from lmforge.data.tokenizer import load_tokenizer, train_bpe

from helpers.tiny_models import tiny_llama


def make_docs(n: int, seed: int = 0, min_words: int = 3, max_words: int = 60) -> list[str]:
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 8)))
             for _ in range(400)]
    return [" ".join(rng.choices(words, k=rng.randint(min_words, max_words)))
            for _ in range(n)]


def fp64_llama(vocab: int, max_seq_len: int):
    """The tiny random Llama in float64, so packed and separate runs compare tightly."""
    return tiny_llama(dtype=torch.float64, vocab_size=vocab, max_seq_len=max_seq_len)


def trained_runs(tok, ids, trained) -> list[str]:
    """The decoded runs of consecutive trained tokens of one SFT sample."""
    runs, current = [], []
    for i, t in zip(ids.tolist(), trained.tolist()):
        if t:
            current.append(i)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tok.decode(r, skip_special=False) for r in runs]


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


LLAMA3_SPECIALS = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tokenizer")
    tok = train_bpe(make_docs(400, seed=123), vocab_size=600)
    tok._tok.add_special_tokens(LLAMA3_SPECIALS)  # so the llama3 template can be tested
    tok.save(out)
    return out


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    return load_tokenizer(tokenizer_dir)


@pytest.fixture(scope="session")
def docs() -> list[str]:
    return make_docs(300, seed=1)


@pytest.fixture(scope="session")
def megatron():
    """megatron.core.datasets.indexed_dataset, or a clean skip saying why not."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.datasets import indexed_dataset
    except Exception as e:  # ImportError, or an incompatibility with this torch
        pytest.skip(f"megatron-core cannot be imported here: {type(e).__name__}: {e}")
    return indexed_dataset
