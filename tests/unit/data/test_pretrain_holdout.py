"""Pretraining without data.eval_path holds out data.eval_fraction of the documents (the
same ones whatever the seed), trains on the rest, and evaluates on the held-out ones; a
corpus too small to split trains on all of it and says why there is no evaluation."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from lmforge.config import JobConfig
from lmforge.data.build import build_data
from lmforge.data.indexed import IndexedDataset
from lmforge.data.loader import build_dataset_loader
from lmforge.data.dataset import held_out_documents, split_documents
from lmforge.data.pretrain import BlendedDataset
from lmforge.data.preprocess import preprocess
from lmforge.data.tokenizer import load_tokenizer

from .conftest import make_docs, write_jsonl

SEQ = 16


@pytest.fixture(scope="module")
def root(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("holdout")
    for name, n_docs, words in (("a", 120, 25), ("small", 1, 60)):
        src = write_jsonl(root / f"{name}.jsonl",
                          [{"text": d} for d in make_docs(n_docs, seed=5, max_words=words)])
        preprocess([src], root / name, tokenizer_dir, append_eod=True)
    load_tokenizer(tokenizer_dir).save(root / "tok")
    return root


def _cfg(path, seed=0, **data) -> JobConfig:
    cfg = JobConfig()
    cfg.train.seed = seed
    cfg.data.kind, cfg.data.path = "pretrain", path
    cfg.data.seq_len, cfg.data.micro_batch_size = SEQ, 2
    for k, v in data.items():
        setattr(cfg.data, k, v)
    return cfg


def test_held_out_documents_are_the_fraction_by_index_alone():
    held = held_out_documents(1000, 0.05)
    assert len(held) == 50 and list(held) == sorted(set(held.tolist()))
    assert np.array_equal(held, held_out_documents(1000, 0.05))
    train = split_documents(1000, 0.05, "train")
    assert sorted(np.concatenate([train, held]).tolist()) == list(range(1000))
    assert len(held_out_documents(3, 0.05)) == 1  # at least one, when some are left
    assert len(held_out_documents(1, 0.5)) == 0 and len(held_out_documents(50, 0)) == 0


def test_pretraining_holds_out_documents_and_evaluates_on_them(root):
    prefix, tok = str(root / "a"), load_tokenizer(root / "tok")
    cfg = _cfg(prefix, eval_fraction=0.1)
    data = build_data(cfg, tok, cache_dir=root / "cache")
    assert data.eval_batches is not None
    assert "12 documents" in data.eval_note and "data.eval_fraction=0.1" in data.eval_note
    train_ds = data.train.dataset
    eval_batch = next(data.eval_batches())
    eval_ds = build_dataset_loader(cfg, tok, 0, 1, "eval", root / "cache", holdout=True).dataset
    assert sorted(train_ds.documents.tolist() + eval_ds.documents.tolist()) == \
        list(range(120))
    assert not set(train_ds.documents.tolist()) & set(eval_ds.documents.tolist())
    # the held-out windows are cut from the held-out documents alone
    whole = IndexedDataset(prefix)
    order = eval_ds.epoch_index(0)[0]
    stream = np.concatenate([whole[int(eval_ds.documents[o])] for o in order])
    for j in range(eval_ds.samples_per_epoch):
        np.testing.assert_array_equal(np.concatenate(eval_ds.window_pieces(0, j)),
                                      stream[j * SEQ:j * SEQ + SEQ + 1])
    assert eval_batch["input_ids"].shape == (2, SEQ)
    # each pass reads the same batches; another seed holds out the same documents
    assert (next(data.eval_batches())["input_ids"] == eval_batch["input_ids"]).all()
    np.testing.assert_array_equal(eval_batch["input_ids"][0], eval_ds[0]["input_ids"])
    other = build_dataset_loader(_cfg(prefix, seed=9, eval_fraction=0.1), tok, 0, 1, "eval",
                                 root / "cache", holdout=True).dataset
    assert np.array_equal(other.documents, eval_ds.documents)


def test_a_corpus_too_small_to_split_trains_on_all_of_it_and_says_why(root):
    prefix = str(root / "small")  # one document: nothing to hold out
    data = build_data(_cfg(prefix), load_tokenizer(root / "tok"), cache_dir=root / "cache")
    assert data.eval_batches is None and data.train.dataset.documents is None
    assert data.eval_note.startswith("nothing held out (") and "too few documents (1)" in data.eval_note
    assert "data.eval_path" in data.eval_note
    off = build_data(_cfg(prefix, eval_fraction=0.0), load_tokenizer(root / "tok"),
                     cache_dir=root / "cache")
    assert off.eval_batches is None and "data.eval_fraction=0" in off.eval_note


@pytest.mark.parametrize("dp", [1, 2])
def test_an_evaluation_pass_scores_each_held_out_window_once(root, dp):
    cfg = _cfg(str(root / "a"), eval_fraction=0.1)
    cfg.train.eval_batches = 100  # far more than the held-out windows fill
    tok = load_tokenizer(root / "tok")
    ranks = [list(build_data(cfg, tok, r, dp, cache_dir=root / "cache").eval_batches())
             for r in range(dp)]
    assert len({len(batches) for batches in ranks}) == 1  # the same passes on every rank
    scored = [int(i) for batches in ranks for b in batches
              for i, labels in zip(b["sample_ids"], b["labels"]) if (labels != -100).any()]
    distinct = build_dataset_loader(cfg, tok, 0, 1, "eval", root / "cache",
                                    holdout=True).dataset.samples_per_epoch
    assert 4 < distinct < 100
    assert sorted(scored) == list(range(distinct))


def test_a_blend_gives_distinct_samples_until_its_first_dataset_repeats():
    parts = [SimpleNamespace(distinct_samples=n) for n in (5, 40, 7)]
    blend = BlendedDataset(parts, [0.2, 0.5, 0.3], block=16)
    n = blend.distinct_samples
    seen = [blend.source(k) for k in range(n + 1)]
    assert all(local < parts[d].distinct_samples for d, local in seen[:n])
    d, local = seen[n]
    assert local == parts[d].distinct_samples  # sample n is the first repeat
