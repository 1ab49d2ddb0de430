"""Packed pretraining windows: the sample index, epochs, caching, blending, and
document masking checked against the model."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lmforge.data.errors import DataError
from lmforge.data.indexed import IndexedDataset
from lmforge.data.dataset import collate, make_row
from lmforge.models.attention import DocumentMask
from lmforge.data.loader import build_pretrain_dataset, pretrain_sources
from lmforge.data.pretrain import BlendedDataset, PretrainDataset
from lmforge.data.preprocess import preprocess

from .conftest import fp64_llama, make_docs, write_jsonl

SEQ = 32


@pytest.fixture(scope="module")
def prefix(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("pretrain")
    src = write_jsonl(root / "a.jsonl", [{"text": d} for d in make_docs(120, seed=2,
                                                                          max_words=25)])
    preprocess([src], root / "a", tokenizer_dir, append_eod=True)
    return str(root / "a")


def test_windows_follow_the_epoch_document_order(prefix):
    ds = PretrainDataset(prefix, SEQ, seed=7)
    data = IndexedDataset(prefix)
    assert ds.samples_per_epoch == (data.num_tokens - 1) // SEQ
    for epoch in (0, 1):
        order = ds.epoch_index(epoch)[0]
        assert sorted(order.tolist()) == list(range(data.num_documents))
        stream = np.concatenate([data[int(d)] for d in order])
        for j in range(ds.samples_per_epoch):
            window = np.concatenate(ds.window_pieces(epoch, j))
            np.testing.assert_array_equal(window, stream[j * SEQ:j * SEQ + SEQ + 1])
    row = ds[0]
    assert row["input_ids"].shape == row["labels"].shape == (SEQ,)
    np.testing.assert_array_equal(row["labels"][:-1], row["input_ids"][1:])


def test_each_window_once_per_epoch_and_a_new_shuffle_each_epoch(prefix):
    ds = PretrainDataset(prefix, SEQ, seed=7)
    n = ds.samples_per_epoch
    located = [ds.locate(k) for k in range(3 * n)]
    for epoch in range(3):
        windows = [w for e, w in located[epoch * n:(epoch + 1) * n]]
        assert {e for e, _ in located[epoch * n:(epoch + 1) * n]} == {epoch}
        assert sorted(windows) == list(range(n))
    assert ds.epoch_index(0)[2].tolist() != ds.epoch_index(1)[2].tolist()
    assert ds.epoch_index(0)[0].tolist() != ds.epoch_index(1)[0].tolist()
    same = PretrainDataset(prefix, SEQ, seed=7)
    other = PretrainDataset(prefix, SEQ, seed=8)
    np.testing.assert_array_equal(same[5]["input_ids"], ds[5]["input_ids"])
    assert [other.locate(k) for k in range(n)] != located[:n]


def test_index_cache_is_reused_and_rebuilt_when_the_data_changes(tmp_path, tokenizer_dir,
                                                                 monkeypatch, data_cache):
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": d} for d in make_docs(60, seed=3)])
    preprocess([src], tmp_path / "a", tokenizer_dir, append_eod=True)
    first = PretrainDataset(tmp_path / "a", SEQ, seed=1)
    expected = first[3]["input_ids"]
    cache_root = first.cache.parent  # under $LMFORGE_CACHE, nothing beside the data
    assert cache_root.parent == data_cache / "pretrain-index"
    assert list(first.cache.glob("epoch-000000-*.npy"))
    assert not list(tmp_path.glob("*lmforge*"))

    def boom(*a, **k):
        raise AssertionError("index rebuilt although cached")

    with monkeypatch.context() as m:
        m.setattr(PretrainDataset, "_window_starts", boom)
        np.testing.assert_array_equal(PretrainDataset(tmp_path / "a", SEQ, seed=1)[3][
            "input_ids"], expected)
    # other parameters: another index beside the first
    assert PretrainDataset(tmp_path / "a", SEQ * 2, seed=1).cache != first.cache
    assert len([p for p in cache_root.iterdir() if p.is_dir()]) == 2
    # other data (same name): rebuilt, the stale indexes removed
    write_jsonl(src, [{"text": d} for d in make_docs(80, seed=4)])
    preprocess([src], tmp_path / "a", tokenizer_dir, append_eod=True)
    again = PretrainDataset(tmp_path / "a", SEQ, seed=1)
    assert again.cache != first.cache and not first.cache.exists()
    assert again.samples_per_epoch != first.samples_per_epoch


def test_cache_falls_back_when_the_cache_dir_is_unwritable(tmp_path, prefix, monkeypatch):
    import shutil

    for ext in (".bin", ".idx"):
        shutil.copy(prefix + ext, tmp_path / f"ro{ext}")
    (tmp_path / "not-a-dir").write_text("")  # mkdir under it fails, even for root
    monkeypatch.setenv("LMFORGE_CACHE", str(tmp_path / "not-a-dir"))
    ds = PretrainDataset(tmp_path / "ro", SEQ, seed=1, cache_dir=tmp_path / "run-cache")
    assert str(ds.cache).startswith(str(tmp_path / "run-cache"))
    np.testing.assert_array_equal(ds[0]["input_ids"], PretrainDataset(prefix, SEQ, 1)[0][
        "input_ids"])


def test_data_shorter_than_one_window_is_refused(tmp_path, tokenizer_dir):
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": "tiny"}])
    preprocess([src], tmp_path / "a", tokenizer_dir)
    with pytest.raises(DataError, match="fewer than one window"):
        PretrainDataset(tmp_path / "a", 512)


def test_blend_is_exact_and_walks_each_stream_in_order(prefix, tmp_path, tokenizer_dir):
    src = write_jsonl(tmp_path / "b.jsonl", [{"text": d} for d in make_docs(80, seed=6)])
    preprocess([src], tmp_path / "b", tokenizer_dir, append_eod=True)
    blend = build_pretrain_dataset(pretrain_sources([[0.7, prefix], [0.3, str(tmp_path / "b")]],
                                                    "data.blend"), SEQ, seed=3)
    assert isinstance(blend, BlendedDataset)
    blend.block = 1000
    sources = [blend.source(k) for k in range(5000)]
    counts = np.bincount([d for d, _ in sources])
    assert counts.tolist() == [3500, 1500]
    for d in (0, 1):  # each stream read from 0 upwards, nothing skipped or repeated
        assert [i for s, i in sources if s == d] == list(range(counts[d]))
    for k in (0, 1, 2, 999, 1000, 4321):  # random access agrees with the walk
        fresh = build_pretrain_dataset([(0.7, prefix), (0.3, str(tmp_path / "b"))], SEQ, 3)
        fresh.block = 1000
        assert fresh.source(k) == sources[k]
    first_window = blend[0]["input_ids"]
    np.testing.assert_array_equal(first_window, PretrainDataset(prefix, SEQ, 3)[0]["input_ids"])


def test_data_path_and_blend_forms_give_weighted_prefixes_or_name_the_field(prefix):
    assert pretrain_sources(prefix, "data.path") == [(None, prefix)]
    assert pretrain_sources(prefix + ".bin", "data.path") == [(None, prefix)]
    assert pretrain_sources([prefix, prefix], "data.path") == [(None, prefix)] * 2
    assert pretrain_sources(["0.5", prefix, 1, prefix], "data.blend") == [
        (0.5, prefix), (1.0, prefix)]
    with pytest.raises(DataError, match="data.blend: weight -1"):
        pretrain_sources([[-1, prefix]], "data.blend")
    with pytest.raises(DataError, match="data.path: nope.bin/.idx not found"):
        pretrain_sources("nope", "data.path")


# ---------------------------------------------------------------- document masking

def _loss_sum(model, tokens, labels, **kw):
    logits = model(tokens, **kw)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                           reduction="sum")


def _grads(model, loss):
    model.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_document_mask_packed_equals_documents_alone(prefix, tokenizer):
    seq = 96
    ds = PretrainDataset(prefix, seq, seed=7, document_mask=True)
    model = fp64_llama(tokenizer.vocab_size, max_seq_len=128)
    ks = [k for k in range(40) if len(ds.window_pieces(*ds.locate(k))) >= 3][:2]
    assert len(ks) == 2, "the test needs windows holding several documents"
    batch = collate([ds[k] for k in ks], ks)
    assert batch["segments"].shape == (2, seq) and "mask" not in batch
    packed = _loss_sum(model, batch["input_ids"], batch["labels"],
                       positions=batch["positions"], mask=DocumentMask(batch["segments"]))
    packed_count = int((batch["labels"] != -100).sum())
    packed_grads = _grads(model, packed)

    alone, count = 0.0, 0
    for k in ks:
        for piece in ds.window_pieces(*ds.locate(k)):
            if len(piece) < 2:
                continue
            t = torch.as_tensor(piece.astype(np.int64))[None]
            alone = alone + _loss_sum(model, t[:, :-1], t[:, 1:])
            count += len(piece) - 1
    alone_grads = _grads(model, alone)
    assert packed_count == count
    torch.testing.assert_close(packed / packed_count, alone / count, rtol=1e-10, atol=1e-10)
    for name in packed_grads:
        torch.testing.assert_close(packed_grads[name], alone_grads[name], rtol=1e-8,
                                   atol=1e-10, msg=name)
    # sanity: the same window without the mask is different
    plain = PretrainDataset(prefix, seq, seed=7)
    b = collate([plain[k] for k in ks], ks)
    assert "mask" not in b
    assert not torch.allclose(_loss_sum(model, b["input_ids"], b["labels"]) /
                              int((b["labels"] != -100).sum()), packed / packed_count)


def test_packed_row_restarts_positions_per_document_and_pads_untrained():
    row = make_row([np.array([1, 2, 3]), np.array([4, 5]), np.array([6])], seq_len=8,
                   document_mask=True, pad_id=0)
    assert row["input_ids"].tolist() == [1, 2, 3, 4, 5, 6, 0, 0]
    assert row["labels"].tolist() == [2, 3, -100, 5, -100, -100, -100, -100]
    assert row["positions"].tolist() == [0, 1, 2, 0, 1, 0, 0, 1]
    assert row["segments"].tolist() == [0, 0, 0, 1, 1, 2, 3, 3]
