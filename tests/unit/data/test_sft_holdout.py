"""SFT without data.eval_path holds out data.eval_fraction of the samples, chosen by their
index in the file alone (not the data-parallel layout, not packing): training never reads
them, evaluation reads only them, masked as in training; a file too small to split trains
on all of it and says why there is no evaluation."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from lmforge.config import load_config
from lmforge.data.build import build_data
from lmforge.data.loader import build_dataset_loader
from lmforge.data.dataset import held_out_documents
from lmforge.data.sft import SFTDataset, iter_jsonl, record_messages
from lmforge.data.sft_rows import sft_row

from .conftest import make_docs, trained_runs, write_jsonl

SEQ, MICRO, N = 128, 2, 40


def _records(n: int) -> list[dict]:
    words = make_docs(2 * n, seed=21, min_words=1, max_words=5)
    return [{"prompt": words[2 * i], "response": f"answer {i} " + words[2 * i + 1]}
            for i in range(n)]


@pytest.fixture(scope="module")
def sft_path(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("sft_holdout") / "chat.jsonl", _records(N))


def _cfg(path, *overrides):
    return load_config(None, ["data.kind=sft", f"data.path={path}", "data.template=llama3",
                              f"data.seq_len={SEQ}", f"data.micro_batch_size={MICRO}",
                              *overrides])


def _records_read(loaders, micro_steps: int) -> set[int]:
    """The file's sample ids in the rows the ``loaders`` (one per rank) hand out."""
    read = set()
    for ld in loaders:
        for _ in range(micro_steps):
            for k in ld.next_batch()["sample_ids"].tolist():
                read.update(ld.dataset.samples_of(k))
    return read


@pytest.mark.parametrize("pack", [False, True])
def test_training_and_held_out_samples_split_the_file_whatever_the_layout(
        sft_path, tokenizer, tmp_path, pack):
    cfg = _cfg(sft_path, "data.eval_fraction=0.2", f"data.pack={pack}")
    cache = tmp_path / "cache"
    # a packing plan of the whole file, cached first, must not serve the training part
    SFTDataset(sft_path, tokenizer, "llama3", SEQ, cfg.train.seed, pack, cache).epoch_plan(0)
    held = set(held_out_documents(N, 0.2).tolist())
    assert len(held) == 8
    for dp in (1, 2):
        train = [build_dataset_loader(cfg, tokenizer, r, dp, "train", cache, holdout=True)
                 for r in range(dp)]
        held_out = [build_dataset_loader(cfg, tokenizer, r, dp, "eval", cache, holdout=True)
                    for r in range(dp)]
        assert set(train[0].dataset.rows.tolist()) == set(range(N)) - held
        assert set(held_out[0].dataset.rows.tolist()) == held
        # two epochs of rows, over all ranks: every training sample, no held-out one
        epoch = train[0].dataset.rows_in_epoch(0)
        assert _records_read(train, 2 * epoch // (MICRO * dp) + 1) == set(range(N)) - held
        assert _records_read(held_out, 8 // (MICRO * dp)) <= held


def test_held_out_rows_score_only_the_assistant_tokens(sft_path, tokenizer, tmp_path):
    cfg = _cfg(sft_path, "data.eval_fraction=0.2", "train.eval_batches=2")
    data = build_data(cfg, tokenizer, cache_dir=tmp_path / "cache")
    held_out = build_dataset_loader(cfg, tokenizer, 0, 1, "eval", tmp_path / "cache",
                                    holdout=True).dataset
    records = [obj for _, obj in iter_jsonl(sft_path)]
    batches = list(data.eval_batches())
    assert len(batches) == 2
    for batch in batches:
        for row, k in enumerate(batch["sample_ids"].tolist()):
            (i,) = held_out.samples_of(k)
            expected = sft_row([held_out.sample(i)], SEQ, tokenizer.pad_id, packed=False,
                               width=batch["labels"].shape[1])  # the batch's longest
            assert torch.equal(batch["labels"][row], torch.from_numpy(expected["labels"]))
            labels = batch["labels"][row]
            scored = tokenizer.decode(labels[labels != -100].tolist(), skip_special=False)
            answer = record_messages(records[i], "")[-1]["content"]
            assert scored == answer + "<|eot_id|>"
            ids, trained = held_out.sample(i)
            assert trained_runs(tokenizer, ids, trained) == [scored]


def test_a_file_too_small_to_split_trains_on_all_of_it_and_says_why(tmp_path, tokenizer):
    one = write_jsonl(tmp_path / "one.jsonl", _records(1))
    data = build_data(_cfg(one), tokenizer, cache_dir=tmp_path / "cache")
    assert data.eval_batches is None and data.train.dataset.num_samples == 1
    assert data.eval_note.startswith("nothing held out (") and "too few samples (1)" in \
        data.eval_note and "data.eval_path" in data.eval_note
    # 1 of 4 held out would leave 3 training samples, fewer than a micro-batch of 4
    four = write_jsonl(tmp_path / "four.jsonl", _records(4))
    data = build_data(_cfg(four, "data.micro_batch_size=4"), tokenizer,
                      cache_dir=tmp_path / "cache")
    assert data.eval_batches is None and data.train.dataset.num_samples == 4
    assert "3 training samples" in data.eval_note and "data.micro_batch_size=4" in \
        data.eval_note and "data.eval_path" in data.eval_note


def test_an_sft_run_without_eval_path_evaluates_by_default(sft_path, tokenizer, tmp_path):
    cfg = _cfg(sft_path)
    assert cfg.data.eval_fraction == 0.05 and cfg.data.eval_path is None
    data = build_data(cfg, tokenizer, cache_dir=tmp_path / "cache")
    assert data.eval_batches is not None and data.train.dataset.num_samples == N - 2
    held = held_out_documents(N, 0.05)
    ds = data.train.dataset
    tokens = sum(min(len(ds.sample(int(i))[0]), SEQ + 1) for i in held)
    assert data.eval_note == f"2 samples ({tokens:,} tokens) of {sft_path} " \
        "(data.eval_fraction=0.05)"
    first = next(data.eval_batches())["input_ids"]
    assert torch.equal(next(data.eval_batches())["input_ids"], first)  # the same each pass
    assert not np.isin(held, ds.rows).any()


@pytest.mark.parametrize("pack", [False, True])
def test_an_evaluation_pass_scores_each_held_out_sample_once(sft_path, tokenizer, tmp_path,
                                                             pack):
    cfg = _cfg(sft_path, "data.eval_fraction=0.2", f"data.pack={pack}",
               "train.eval_batches=50")  # far more than 8 held-out samples fill
    ranks = [build_data(cfg, tokenizer, r, 2, cache_dir=tmp_path) for r in (0, 1)]
    passes = [list(data.eval_batches()) for data in ranks]
    assert len(passes[0]) == len(passes[1])
    dataset = build_dataset_loader(cfg, tokenizer, 0, 2, "eval", tmp_path,
                                   holdout=True).dataset
    scored = [s for batches in passes for b in batches
              for k, labels in zip(b["sample_ids"].tolist(), b["labels"])
              if (labels != -100).any() for s in dataset.samples_of(k)]
    assert sorted(scored) == sorted(held_out_documents(N, 0.2).tolist())
