"""The loader: rank split without overlap, exact resume, workers, eval batches."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from lmforge.config import JobConfig
from lmforge.data.errors import DataError
from lmforge.data.indexed import IndexedDataset
from lmforge.data.evalsets import eval_dataset
from lmforge.data.loader import BatchLoader, build_dataset_loader
from lmforge.data.preprocess import preprocess
from lmforge.data.sampler import MicroBatchSampler

from .conftest import make_docs, write_jsonl

SEQ, MICRO, ACCUM = 32, 2, 2
pytestmark = pytest.mark.filterwarnings("ignore:.*samples dropped:UserWarning")


@pytest.fixture(scope="module")
def data(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("loader")
    texts = make_docs(20, seed=11, max_words=20)
    write_jsonl(root / "a.jsonl", [{"text": t} for t in texts])
    preprocess([root / "a.jsonl"], root / "a", tokenizer_dir, append_eod=True)
    write_jsonl(root / "b.jsonl", [{"text": t} for t in make_docs(40, seed=12)])
    preprocess([root / "b.jsonl"], root / "b", tokenizer_dir, append_eod=True)
    words = make_docs(80, seed=13, min_words=1, max_words=3)
    write_jsonl(root / "sft.jsonl", [{"prompt": words[2 * i], "response": words[2 * i + 1]}
                                     for i in range(30)])
    return root


def _cfg(data, kind, **data_fields) -> JobConfig:
    cfg = JobConfig()
    cfg.train.seed = 42
    cfg.data.kind = kind
    cfg.data.seq_len, cfg.data.micro_batch_size = SEQ, MICRO
    cfg.data.path = str(data / ("sft.jsonl" if kind == "sft" else "a"))
    for k, v in data_fields.items():
        setattr(cfg.data, k, v)
    return cfg


CASES = {
    "pretrain": ("pretrain", {}),
    "pretrain-docmask-blend": ("pretrain", {"document_mask": True,
                                            "blend": [[0.6, "{d}/a"], [0.4, "{d}/b"]]}),
    "sft": ("sft", {"template": "plain"}),
    "sft-packed": ("sft", {"template": "llama3", "pack": True}),
    # the training part of data.eval_fraction's split (holdout: a build_dataset_loader flag)
    "sft-packed-holdout": ("sft", {"template": "llama3", "pack": True, "eval_fraction": 0.2,
                                   "holdout": True}),
}


def _make(data, case, tokenizer, rank, dp, workers=0):
    kind, fields = CASES[case]
    fields = dict(fields)
    holdout = fields.pop("holdout", False)
    if "blend" in fields:
        fields["blend"] = [[w, p.format(d=data)] for w, p in fields["blend"]]
    return build_dataset_loader(_cfg(data, kind, num_workers=workers, **fields), tokenizer,
                                rank, dp, cache_dir=data / "cache", holdout=holdout)


def _steps(loaders, steps):
    """Per rank: the batches of ``steps`` optimizer steps of ACCUM micro-batches."""
    return [[ld.next_batch() for _ in range(steps * ACCUM)] for ld in loaders]


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dp", [1, 2])
def test_resume_gives_the_uninterrupted_sequence(data, tokenizer, case, dp):
    steps = 12  # crosses an epoch boundary for every case
    straight = _steps([_make(data, case, tokenizer, r, dp) for r in range(dp)], steps)
    first = [_make(data, case, tokenizer, r, dp) for r in range(dp)]
    head = _steps(first, steps // 2)
    states = [json.loads(json.dumps(ld.state_dict())) for ld in first]  # JSON-clean
    assert all(s == states[0] for s in states)  # rank-independent
    resumed = [_make(data, case, tokenizer, r, dp) for r in range(dp)]
    for ld, s in zip(resumed, states):
        ld.load_state_dict(s)
    tail = _steps(resumed, steps - steps // 2)
    for r in range(dp):
        for a, b in zip(straight[r], head[r] + tail[r]):
            _same(a, b)
    ids = torch.cat([b["sample_ids"] for rank in straight for b in rank]).tolist()
    assert sorted(ids) == list(range(steps * ACCUM * MICRO * dp))  # none repeated or skipped
    batch = straight[0][0]
    width = batch["input_ids"].shape[1]  # unpacked SFT: the longest row's, a multiple of 8
    assert width == SEQ or (case == "sft" and width % 8 == 0)
    assert batch["input_ids"].shape == batch["labels"].shape == (MICRO, width)
    assert batch["input_ids"].dtype == batch["labels"].dtype == torch.long
    if "segments" in batch:
        assert batch["segments"].shape == (MICRO, SEQ) and batch["segments"].dtype == torch.long
        assert batch["positions"].shape == (MICRO, SEQ)
    ds = first[0].dataset
    epoch = getattr(ds, "samples_per_epoch", None) or getattr(ds, "rows_in_epoch", None)
    if epoch is not None:
        assert steps * ACCUM * MICRO * dp > (epoch if isinstance(epoch, int) else epoch(0))


def test_ranks_partition_each_step(data, tokenizer):
    loaders = [_make(data, "pretrain", tokenizer, r, 2) for r in range(2)]
    for micro in range(4):
        ids = [ld.next_batch()["sample_ids"].tolist() for ld in loaders]
        assert ids[0] == [4 * micro, 4 * micro + 1] and ids[1] == [4 * micro + 2, 4 * micro + 3]


def test_resume_on_another_data_parallel_size_continues_the_global_order(data, tokenizer):
    two = [_make(data, "pretrain", tokenizer, r, 2) for r in range(2)]
    _steps(two, 3)
    one = _make(data, "pretrain", tokenizer, 0, 1)
    one.load_state_dict(two[0].state_dict())
    assert one.next_batch()["sample_ids"].tolist() == [24, 25]
    bad = _make(data, "pretrain", tokenizer, 0, 1)
    with pytest.raises(DataError, match="not a multiple"):
        bad.sampler.load_state_dict({"consumed_samples": 3})
    state = dict(two[0].state_dict(), seed=7)
    with pytest.raises(DataError, match="train.seed=7"):
        one.load_state_dict(state)


def test_workers_give_the_same_batches_and_resume(data, tokenizer):
    plain = _steps([_make(data, "sft-packed", tokenizer, 1, 2)], 4)[0]
    ahead = _make(data, "sft-packed", tokenizer, 1, 2, workers=2)
    got = _steps([ahead], 2)[0]
    state = ahead.state_dict()  # prefetched batches are not counted
    ahead.close()
    again = _make(data, "sft-packed", tokenizer, 1, 2, workers=2)
    again.load_state_dict(state)
    got += _steps([again], 2)[0]
    for a, b in zip(plain, got):
        _same(a, b)


def test_sampler_gives_each_rank_its_slice_and_refuses_a_rank_out_of_range():
    s = MicroBatchSampler(3, dp_rank=1, dp_size=2)
    assert s.next_indices() == [3, 4, 5] and s.next_indices() == [9, 10, 11]
    assert s.state_dict() == {"consumed_samples": 12}
    with pytest.raises(DataError, match="rank 2"):
        MicroBatchSampler(1, 2, 2)


def test_eval_split_needs_eval_path_and_a_missing_path_is_named(data, tokenizer):
    cfg = _cfg(data, "pretrain")
    with pytest.raises(DataError, match="data.eval_path: not set"):
        build_dataset_loader(cfg, tokenizer, 0, 1, split="eval")
    cfg.data.eval_path = str(data / "b")
    assert build_dataset_loader(cfg, tokenizer, 0, 1, split="eval").dataset.prefix == \
        str(data / "b")
    cfg.data.path = str(data / "missing")
    with pytest.raises(DataError, match="data.path: .*missing.bin/.idx not found"):
        build_dataset_loader(cfg, tokenizer, 0, 1)


def test_eval_batches_cover_every_token_once(data, tokenizer):
    ds = IndexedDataset(data / "a")
    stream = np.concatenate([ds.document(i) for i in range(ds.num_documents)])
    batches = list(iter_eval_batches(None, tokenizer, data / "a", SEQ, 4))
    labels = torch.cat([b["labels"] for b in batches]).flatten()
    np.testing.assert_array_equal(labels[labels != -100].numpy(), stream[1:])
    assert torch.cat([b["sample_ids"] for b in batches]).tolist() == list(
        range(sum(len(b["sample_ids"]) for b in batches)))
    # the .jsonl it was made from gives the same batches (documents + EOD)
    from_jsonl = list(iter_eval_batches(None, tokenizer, data / "a.jsonl", SEQ, 4))
    for a, b in zip(batches, from_jsonl, strict=True):
        _same(a, b)
    # with document masking: same targets minus those crossing documents
    cfg = _cfg(data, "pretrain", document_mask=True)
    masked = list(iter_eval_batches(cfg, tokenizer, str(data / "a") + ".bin", SEQ, 4))
    n_masked = sum(int((b["labels"] != -100).sum()) for b in masked)
    assert "segments" in masked[0] and n_masked == len(stream) - 1 - (ds.num_documents - 1)


def test_eval_batches_read_sft_and_text_files_and_refuse_other_suffixes(data, tokenizer, tmp_path):
    cfg = _cfg(data, "sft", template="plain")
    rows = torch.cat([b["input_ids"] for b in iter_eval_batches(
        cfg, tokenizer, data / "sft.jsonl", SEQ, 8)])
    assert rows.shape == (30, SEQ)
    (tmp_path / "t.txt").write_text("one two three four " * 20)
    batches = list(iter_eval_batches(None, tokenizer, tmp_path / "t.txt", SEQ, 8))
    labels = torch.cat([b["labels"] for b in batches]).flatten()
    # one document as the tokenizer encodes it, no EOD after it (transformers' loss)
    assert labels[labels != -100].tolist() == tokenizer.encode("one two three four " * 20)[1:]
    with pytest.raises(DataError, match="not a PREFIX"):
        list(iter_eval_batches(None, tokenizer, tmp_path / "x.csv", SEQ, 8))


def iter_eval_batches(cfg, tokenizer, path, seq_len, batch_size):
    """Every token of ``path`` once, as ``lmforge eval`` reads it."""
    return BatchLoader(eval_dataset(path, tokenizer, seq_len, cfg), batch_size).held_out_batches()
