"""SFT batches grouped by length (data.group_by_length): every sample once per epoch,
deterministic and resumable, equal shares for data-parallel ranks, less padding than
random batches, the start-up line that says so, and the refusal with packing."""
from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from lmforge.config import ConfigError, load_config, validate
from lmforge.data.build import build_data
from lmforge.data.loader import build_dataset_loader

from .conftest import make_docs, write_jsonl

SEQ, MICRO, GLOBAL = 96, 4, 8
SAMPLES = 90  # not a multiple of GLOBAL: epochs start mid-step


@pytest.fixture
def skewed(tmp_path):
    """Mostly short samples and a few long ones, as chat sets are."""
    short = make_docs(2 * SAMPLES, seed=5, min_words=1, max_words=4)
    long = make_docs(SAMPLES, seed=6, min_words=8, max_words=12)
    records = [{"prompt": long[i] if i % 6 == 0 else short[2 * i],
                "response": short[2 * i + 1]} for i in range(SAMPLES)]
    return write_jsonl(tmp_path / "skewed.jsonl", records)


def _cfg(path, *overrides, group=True):
    return load_config(None, ["data.kind=sft", f"data.path={path}", "data.template=plain",
                              f"data.seq_len={SEQ}", f"data.micro_batch_size={MICRO}",
                              f"data.global_batch_size={GLOBAL}", "data.eval_fraction=0",
                              f"data.group_by_length={str(group).lower()}", *overrides])


def _loader(path, tokenizer, rank=0, dp=1, group=True):
    overrides = [f"data.global_batch_size={GLOBAL * dp}"] if dp > 1 else []
    return build_dataset_loader(_cfg(path, *overrides, group=group), tokenizer, rank, dp)


def _samples(loader, batch) -> list[int]:
    """The file's sample ids behind a batch's rows."""
    return [i for k in batch["sample_ids"].tolist() for i in loader.dataset.samples_of(k)]


def _padding(loader, epochs=1, skip=0) -> float:
    """The share of padding in this rank's micro-batches of ``epochs`` epochs after
    ``skip`` (a last micro-batch that runs past them counted as if alone)."""
    ds = loader.dataset
    rows = ds.rows_in_epoch(0)
    first, end = skip * rows, (skip + epochs) * rows
    loader.load_state_dict(loader.state_dict() | {"consumed_samples": first // MICRO * MICRO})
    filled = positions = 0
    while loader.consumed_samples < end:
        batch = loader.next_batch()
        ks = [k for k in batch["sample_ids"].tolist() if first <= k < end]
        width = batch["input_ids"].shape[1] if len(ks) == MICRO else \
            len(ds.batch_rows(ks)[0]["input_ids"])
        filled += sum(int(ds.sizes[ds.samples_of(k)].sum()) for k in ks)
        positions += len(ks) * width
    return 1 - filled / positions


def test_a_grouped_epoch_reads_every_sample_once(skewed, tokenizer):
    grouped, plain = (_loader(skewed, tokenizer, group=g).dataset for g in (True, False))
    for epoch in (0, 1, 2):
        items = grouped.epoch_plan(epoch)[1]
        assert Counter(items.tolist()) == Counter(plain.epoch_plan(epoch)[1].tolist())
        assert sorted(items.tolist()) == sorted(grouped.rows.tolist())
    assert grouped.epoch_plan(0)[1].tolist() != plain.epoch_plan(0)[1].tolist()


def test_grouped_batches_are_deterministic_and_a_mid_epoch_resume_reads_the_same(
        skewed, tokenizer):
    steps = 2 * math.ceil(SAMPLES / MICRO)  # two epochs and a bit
    reference = _loader(skewed, tokenizer)
    expected = [reference.next_batch() for _ in range(steps)]
    again = _loader(skewed, tokenizer)
    assert all(np.array_equal(again.next_batch()["input_ids"], b["input_ids"])
               for b in expected)
    first = _loader(skewed, tokenizer)
    for _ in range(7):  # 28 samples: mid-epoch and mid-step
        first.next_batch()
    resumed = _loader(skewed, tokenizer)
    resumed.load_state_dict(first.state_dict())
    for b in expected[7:]:
        got = resumed.next_batch()
        assert got["sample_ids"].tolist() == b["sample_ids"].tolist()
        assert np.array_equal(got["input_ids"], b["input_ids"])
        assert np.array_equal(got["labels"], b["labels"])


def test_two_data_parallel_ranks_read_equal_shares_of_each_grouped_epoch(skewed, tokenizer):
    ranks = [_loader(skewed, tokenizer, rank=r, dp=2) for r in range(2)]
    micro_steps = ranks[0].dataset.num_samples // (MICRO * 2)
    read = [[_samples(loader, loader.next_batch()) for _ in range(micro_steps)]
            for loader in ranks]
    counts = [sum(len(b) for b in batches) for batches in read]
    assert counts[0] == counts[1] == micro_steps * MICRO
    together = [i for batches in read for b in batches for i in b]
    assert len(set(together)) == len(together)  # the ranks never read the same sample
    epoch = ranks[0].dataset.epoch_plan(0)[1].tolist()
    assert sorted(together) == sorted(epoch[:len(together)])


def test_grouping_pads_less_than_random_batches_and_the_start_up_line_says_so(
        skewed, tokenizer):
    plain = build_data(_cfg(skewed, group=False), tokenizer)
    grouped = build_data(_cfg(skewed), tokenizer)
    share, plain_share = (d.stats["sft_padding_share"] for d in (grouped, plain))
    assert plain_share > 0.15 and share < plain_share / 2
    assert "data.group_by_length=true" in plain.notes[-1] and \
        "data.pack=true" in plain.notes[-1]
    assert "batched together (data.group_by_length)" in grouped.notes[-1]
    assert "data.group_by_length=true" not in grouped.notes[-1]
    assert share == pytest.approx(_padding(grouped.train))  # epoch 0's micro-batches
    later = (_padding(_loader(skewed, tokenizer, group=g), epochs=2, skip=1)
             for g in (True, False))  # epochs that start mid-step
    assert next(later) < next(later) / 2


def test_pipeline_parallel_keeps_the_grouped_order_and_says_it_saves_nothing(skewed,
                                                                             tokenizer):
    data = build_data(_cfg(skewed, "parallel.pp=2"), tokenizer)
    assert "data.group_by_length orders the samples but saves nothing" in data.notes[-1]
    assert "data.pack=true" not in data.notes[-1]  # refused with pipeline parallelism
    grouped = _loader(skewed, tokenizer).dataset
    assert np.array_equal(data.train.dataset.epoch_plan(0)[1], grouped.epoch_plan(0)[1])


@pytest.mark.parametrize("overrides, message", [
    (["data.pack=true"], r"^data\.group_by_length: cannot be combined with data\.pack=true"),
    (["data.kind=pretrain"], r"^data\.group_by_length: only SFT samples vary in length")])
def test_grouping_is_refused_with_packing_and_outside_sft(skewed, overrides, message):
    validate(_cfg(skewed))
    with pytest.raises(ConfigError, match=message):
        validate(_cfg(skewed, *overrides))


def test_a_resume_with_another_grouping_warns(skewed, tokenizer, capsys):
    grouped, plain = (_loader(skewed, tokenizer, group=g) for g in (True, False))
    grouped.next_batch()
    capsys.readouterr()
    plain.load_state_dict(grouped.state_dict())
    assert "grouped samples by length in steps of 8, this run 0" in capsys.readouterr().err
