"""SFT batches padded to their longest sample: widths, the same loss and gradients as rows
padded to seq_len, the layouts that need fixed or divisible shapes, and the padding share
the run prints at start-up."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lmforge.config import load_config
from lmforge.data.build import build_data
from lmforge.data.dataset import collate
from lmforge.data.loader import build_dataset_loader, sft_pad_multiple
from lmforge.data.sft import SFTDataset
from lmforge.train.step import accumulate_gradients

from .conftest import fp64_llama, make_docs, write_jsonl

SEQ, MICRO = 96, 4


@pytest.fixture
def chat(tmp_path):
    """Samples of very different lengths, a few longer than SEQ + 1 tokens."""
    docs = make_docs(120, seed=4, min_words=1, max_words=14)
    return write_jsonl(tmp_path / "chat.jsonl", [{"prompt": docs[2 * i],
                                                  "response": docs[2 * i + 1]}
                                                 for i in range(60)])


def _cfg(path, *overrides):
    return load_config(None, ["data.kind=sft", f"data.path={path}", "data.template=plain",
                              f"data.seq_len={SEQ}", f"data.micro_batch_size={MICRO}",
                              *overrides])


def _filled(ds, ks) -> list[int]:
    return [int(ds.sizes[ds.samples_of(k)].sum()) for k in ks]


def test_sft_batches_are_padded_to_their_longest_sample_rounded_up(chat, tokenizer):
    loader = build_dataset_loader(_cfg(chat), tokenizer, 0, 1)
    ds, widths = loader.dataset, set()
    for _ in range(15):
        batch = loader.next_batch()
        ks = batch["sample_ids"].tolist()
        width = batch["input_ids"].shape[1]
        assert width == min(SEQ, math.ceil(max(_filled(ds, ks)) / 8) * 8)
        for row, k in enumerate(ks):  # the seq_len row, cut after the batch's longest
            full = ds[k]
            assert (full["labels"][width:] == -100).all()
            np.testing.assert_array_equal(batch["input_ids"][row].numpy(),
                                          full["input_ids"][:width])
            np.testing.assert_array_equal(batch["labels"][row].numpy(), full["labels"][:width])
        widths.add(width)
    assert len(widths) > 1 and min(widths) < SEQ  # lengths vary, most batches are shorter


def test_pipeline_and_pad_to_multiple_of_0_keep_seq_len_and_tp_divides_the_length(chat,
                                                                                  tokenizer):
    assert sft_pad_multiple(_cfg(chat)) == 8
    assert sft_pad_multiple(_cfg(chat, "data.pad_to_multiple_of=64")) == 64
    assert sft_pad_multiple(_cfg(chat, "parallel.tp=3")) == 24  # sequence parallel splits it
    for fixed in ("parallel.pp=2", "data.pad_to_multiple_of=0", "data.pack=true"):
        assert sft_pad_multiple(_cfg(chat, fixed)) is None
        loader = build_dataset_loader(_cfg(chat, fixed), tokenizer, 0, 1)
        assert {loader.next_batch()["input_ids"].shape[1] for _ in range(6)} == {SEQ}
    loader = build_dataset_loader(_cfg(chat, "parallel.tp=3"), tokenizer, 0, 1)
    assert all(loader.next_batch()["input_ids"].shape[1] % 24 == 0 for _ in range(10))


def test_batches_padded_to_their_longest_give_the_loss_and_grads_of_seq_len_padding(
        chat, tokenizer):
    """Two micro-batches of one step, each as long as its longest sample, against the same
    samples padded to seq_len: loss = sum of token CE / the step's valid tokens."""
    ds = SFTDataset(chat, tokenizer, "plain", SEQ, seed=1, pad_to_multiple_of=8)
    by_length = sorted(range(ds.num_samples), key=lambda k: _filled(ds, [k]))
    steps = [by_length[:3], by_length[12:15]]  # the shortest rows, then middling ones
    short = [collate(ds.batch_rows(ks), ks) for ks in steps]
    full = [collate([ds[k] for k in ks], ks) for ks in steps]
    widths = [b["input_ids"].shape[1] for b in short]
    assert widths[0] < widths[1] < SEQ
    results = []
    for micro_batches in (short, full):
        model = fp64_llama(tokenizer.vocab_size, max_seq_len=SEQ)
        loss = accumulate_gradients(model, micro_batches, torch.device("cpu"))
        results.append((loss, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss_s, grads_s), (loss_f, grads_f) = results
    torch.testing.assert_close(loss_s, loss_f, rtol=1e-12, atol=1e-12)
    for name in grads_s:
        torch.testing.assert_close(grads_s[name], grads_f[name], rtol=1e-9, atol=1e-12,
                                   msg=name)


@pytest.mark.parametrize("overrides", [(), ("data.pad_to_multiple_of=0",),
                                       ("data.pack=true",)])
def test_the_padding_share_is_that_of_an_epochs_micro_batches(chat, tokenizer, overrides):
    data = build_data(_cfg(chat, "data.eval_fraction=0", *overrides), tokenizer)
    loader, ds = data.train, data.train.dataset
    rows = ds.rows_in_epoch(0)
    filled = positions = 0
    for _ in range(math.ceil(rows / MICRO)):
        batch = loader.next_batch()
        ks = [k for k in batch["sample_ids"].tolist() if k < rows]  # epoch 0's rows only
        width = batch["input_ids"].shape[1] if len(ks) == MICRO else \
            len(ds.batch_rows(ks)[0]["input_ids"])  # the last, as if alone
        filled += sum(_filled(ds, ks))
        positions += len(ks) * width
    share = 1 - filled / positions
    assert data.stats["sft_padding_share"] == pytest.approx(share)
    note = data.notes[-1]
    assert note.startswith(f"SFT: {ds.num_samples} samples, padding {share:.0%} of the "
                           "positions")
    if not overrides:
        assert "padded to its longest sample" in note and "data.pack=true" in note
        fixed = build_data(_cfg(chat, "data.eval_fraction=0", "data.pad_to_multiple_of=0"),
                           tokenizer)
        assert fixed.stats["sft_padding_share"] > share  # what padding to the longest saves
