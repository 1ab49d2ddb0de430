"""SFT: every template trains on assistant tokens and end-of-turn only; truncation;
packing equals the unpacked samples."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lmforge.config import load_config
from lmforge.data import sft as sft_mod
from lmforge.data.build import build_data, check_data
from lmforge.models.attention import DocumentMask
from lmforge.data.errors import DataError
from lmforge.data.dataset import collate
from lmforge.data.sft import SFTDataset, record_messages
from lmforge.data.sft_rows import sft_row
from lmforge.data.templates import ChatTemplate
from lmforge.data.tokenizer import train_bpe

from .conftest import fp64_llama, make_docs, trained_runs, write_jsonl

CUSTOM = "### Question:\n{prompt}\n\n### Answer: {response} [end]"
TEMPLATES = ["plain", "llama2", "llama3", CUSTOM]

CHAT = [{"role": "system", "content": "be brief"},
        {"role": "user", "content": "what is up"},
        {"role": "assistant", "content": "the sky"},
        {"role": "user", "content": "and down"},
        {"role": "assistant", "content": "the ground below"},
        {"role": "user", "content": "a trailing question is dropped"}]
SIMPLE = {"prompt": "say hi", "response": "hi there"}


def _expected_runs(template, tok, messages):
    eot = ChatTemplate(template).end_of_turn(tok)
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    if template == "llama2":
        return [f" {a}{eot}" for a in answers]
    if template == CUSTOM:
        return [f"{a} [end]{eot}" for a in answers]
    return [a + eot for a in answers]


@pytest.mark.parametrize("template", TEMPLATES)
@pytest.mark.parametrize("record", [SIMPLE, {"messages": CHAT}], ids=["single", "multi"])
def test_only_assistant_tokens_and_end_of_turn_are_trained(tokenizer, template, record):
    t = ChatTemplate(template)
    messages = record_messages(record, "x:1")
    ids, trained = t.encode(messages, tokenizer)
    assert trained_runs(tokenizer, ids, trained) == _expected_runs(template, tokenizer,
                                                                     messages)
    # every prompt, system and user text is there, untrained
    untrained = tokenizer.decode(ids[~trained].tolist(), skip_special=False)
    for m in messages:
        if m["role"] != "assistant":
            assert m["content"] in untrained
    assert "trailing" not in tokenizer.decode(ids.tolist())
    # in a row, a label is set exactly where the next token is trained
    row = sft_row([(ids, trained)], 256, tokenizer.pad_id, packed=False)
    n = len(ids) - 1
    assert ((row["labels"][:n] != -100) == trained[1:]).all()
    assert (row["labels"][n:] == -100).all() and (row["input_ids"][n:] == tokenizer.pad_id).all()
    np.testing.assert_array_equal(row["labels"][:n][trained[1:]], ids[1:][trained[1:]])


def test_builtin_chat_templates_render_the_reference_text(tokenizer):
    messages = record_messages({"messages": CHAT}, "x:1")
    ids, _ = ChatTemplate("llama3").encode(messages, tokenizer)
    assert tokenizer.decode(ids.tolist(), skip_special=False) == (
        "<|begin_of_text|>"
        "<|start_header_id|>system<|end_header_id|>\n\nbe brief<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nwhat is up<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nthe sky<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nand down<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nthe ground below<|eot_id|>")
    ids, _ = ChatTemplate("llama2").encode(messages, tokenizer)
    bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
    assert tokenizer.decode(ids.tolist(), skip_special=False) == (
        f"{bos}[INST] <<SYS>>\nbe brief\n<</SYS>>\n\nwhat is up [/INST] the sky{eos}"
        f"{bos}[INST] and down [/INST] the ground below{eos}")


def test_end_of_turn_is_eot_for_llama3_and_eos_otherwise(tokenizer):
    assert ChatTemplate("llama3").end_of_turn(tokenizer) == "<|eot_id|>"
    for name in ("plain", "llama2", CUSTOM):
        assert ChatTemplate(name).end_of_turn(tokenizer) == "<|end_of_text|>"
    assert ChatTemplate("llama3").end_of_turn_id(tokenizer) == tokenizer.token_to_id("<|eot_id|>")


def test_bad_templates_and_records_are_refused_naming_the_field_or_line(tokenizer):
    with pytest.raises(DataError, match="data.template: 'vicuna' is not one of"):
        ChatTemplate("vicuna")
    with pytest.raises(DataError, match=r"needs \{prompt\} and then \{response\}"):
        ChatTemplate("{response} then {prompt}")
    bare = train_bpe(make_docs(50), 300)  # no Llama-3 header tokens
    with pytest.raises(DataError, match=re.escape("llama3 needs the token '<|start_header_id|>'")):
        ChatTemplate("llama3").encode(record_messages(SIMPLE, "x:1"), bare)
    cases = [({"prompt": "a"}, "'response' must be a string"),
             ({"text": "a"}, "expected keys 'prompt' and 'response', or 'messages'"),
             ({"messages": [{"role": "bot", "content": "x"}]}, "message 1 has role 'bot'"),
             ({"messages": [{"role": "user", "content": "a"},
                            {"role": "user", "content": "b"}]},
              "message 2 is 'user', expected 'assistant'"),
             ({"messages": [{"role": "user", "content": "a"}]}, "no assistant message"),
             ({"messages": [{"role": "user", "content": 3}]}, "message 1 needs a string 'content'")]
    for record, message in cases:
        with pytest.raises(DataError, match="^" + re.escape(f"f.jsonl:4: {message}")):
            record_messages(record, "f.jsonl:4")


def test_file_errors_name_the_line(tmp_path, tokenizer):
    path = tmp_path / "s.jsonl"
    path.write_bytes(b'{"prompt": "a", "response": "b"}\n\n{"prompt": "a", "response": }\n')
    with pytest.raises(DataError, match=r"s\.jsonl:3: not valid JSON"):
        SFTDataset(path, tokenizer, "plain", 64)
    with pytest.raises(DataError, match="no such file"):
        SFTDataset(tmp_path / "none.jsonl", tokenizer, "plain", 64)


def _sft_file(path, n=40, seed=0):
    docs = make_docs(3 * n, seed=seed, min_words=1, max_words=6)
    records = []
    for i in range(n):
        if i % 3 == 0:
            records.append({"messages": [{"role": "user", "content": docs[3 * i]},
                                         {"role": "assistant", "content": docs[3 * i + 1]},
                                         {"role": "user", "content": docs[3 * i + 2]},
                                         {"role": "assistant", "content": "ok"}]})
        else:
            records.append({"prompt": docs[3 * i], "response": docs[3 * i + 1]})
    return write_jsonl(path, records)


def test_long_responses_are_cut_and_prompts_filling_the_window_dropped(tmp_path, tokenizer):
    long_answer = " ".join(make_docs(20, seed=3))
    path = write_jsonl(tmp_path / "t.jsonl", [
        {"prompt": "short", "response": long_answer},           # cut at seq_len + 1
        {"prompt": " ".join(make_docs(20, seed=4)), "response": "x"},  # prompt fills it
        {"prompt": "fine", "response": "ok"}])
    with pytest.warns(UserWarning, match="1 of 3 samples dropped"):
        ds = SFTDataset(path, tokenizer, "plain", 32)
    assert ds.num_samples == 2 and ds.dropped == 1
    row = sft_row([ds.sample(0)], 32, tokenizer.pad_id, packed=False)
    assert (row["input_ids"] != tokenizer.pad_id).all() and (row["labels"] != -100).sum() > 20
    np.testing.assert_array_equal(row["input_ids"], ds.sample(0)[0][:32])


def test_truncated_samples_and_the_tokens_cut_are_counted_and_reported(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "t.jsonl", [
        {"prompt": "short", "response": " ".join(make_docs(20, seed=3))},
        {"prompt": "fine", "response": "ok"},
        {"prompt": "also long", "response": " ".join(make_docs(8, seed=5))}])
    cfg = load_config(None, ["data.kind=sft", f"data.path={path}", "data.template=plain",
                             "data.seq_len=32"])
    data = build_data(cfg, tokenizer, cache_dir=tmp_path / "cache")
    ds = data.train.dataset
    cut = [len(ds.sample(i)[0]) - 33 for i in range(3) if len(ds.sample(i)[0]) > 33]
    assert len(cut) == 2 and ds.truncated_samples == 2 and ds.truncated_tokens == sum(cut)
    assert 0 <= data.stats.pop("sft_padding_share") < 1 and "padding" in data.notes.pop()
    assert data.stats == {"sft_truncated_samples": 2, "sft_truncated_tokens": sum(cut),
                          "sft_dropped_samples": 0, "sft_empty_answer_samples": 0}
    assert len(data.notes) == 1 and "2 of 3 samples" in data.notes[0]
    assert f"({sum(cut):,} tokens lost)" in data.notes[0]
    fits = build_data(load_config(None, ["data.kind=sft", f"data.path={path}",
                                         "data.template=plain", "data.seq_len=4096"]),
                      tokenizer, cache_dir=tmp_path / "cache")
    assert len(fits.notes) == 1 and fits.stats["sft_truncated_samples"] == 0


def test_records_with_an_empty_answer_are_skipped_counted_and_reported(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "t.jsonl", [
        {"prompt": "fine", "response": "ok"},
        {"prompt": "nothing to say", "response": ""},
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                      {"role": "user", "content": "c"}, {"role": "assistant", "content": " "}]},
        {"prompt": "also fine", "response": "yes"}])
    cfg = load_config(None, ["data.kind=sft", f"data.path={path}", "data.template=plain",
                             "data.seq_len=64", "data.eval_fraction=0",
                             "data.micro_batch_size=1"])
    data = build_data(cfg, tokenizer, cache_dir=tmp_path / "cache")
    ds = data.train.dataset
    assert ds.rows.tolist() == [0, 3] and ds.empty_answers == 2 and ds.dropped == 0
    assert data.stats["sft_empty_answer_samples"] == 2
    assert any(n.startswith("SFT data: 2 of 4 records have an empty assistant answer")
               for n in data.notes)


def test_a_file_of_empty_answers_only_is_refused_naming_it(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "p", "response": ""}] * 3)
    with pytest.raises(DataError, match=r"t\.jsonl: every record's assistant answer is "
                                        r"empty \(3 records\)"):
        SFTDataset(path, tokenizer, "plain", 32, cache_dir=tmp_path / "cache")
    cfg = load_config(None, ["data.kind=sft", f"data.path={path}"])
    with pytest.raises(DataError, match=r"^data\.path: .*t\.jsonl: every record's"):
        check_data(cfg)  # what train checks before it writes anything


def test_tokenized_cache_is_reused(tmp_path, tokenizer, monkeypatch, data_cache):
    path = _sft_file(tmp_path / "s.jsonl")
    first = SFTDataset(path, tokenizer, "llama3", 64)
    assert first.cache.parent.parent == data_cache / "sft"
    monkeypatch.setattr(sft_mod, "tokenize_file", lambda *a, **k: 1 / 0)
    again = SFTDataset(path, tokenizer, "llama3", 64)
    np.testing.assert_array_equal(again[3]["input_ids"], first[3]["input_ids"])


def test_packing_plan_covers_each_sample_once_per_epoch(tmp_path, tokenizer):
    ds = SFTDataset(_sft_file(tmp_path / "s.jsonl", n=60), tokenizer, "plain", 128, seed=5,
                    pack=True)
    unpacked_rows = ds.num_samples
    total = 0
    for epoch in range(3):
        rows = ds.rows_in_epoch(epoch)
        assert rows < unpacked_rows  # packing saves rows
        seen = []
        for r in range(rows):
            k = total + r
            assert ds.locate(k) == (epoch, r)
            ids = ds.samples_of(k)
            assert ds.sizes[ids].sum() <= 128
            seen += ids
        assert sorted(seen) == sorted(ds.rows.tolist())
        total += rows
    assert ds.samples_of(0) != ds.samples_of(ds.rows_in_epoch(0))  # reshuffled


def _loss_and_grads(model, batch, **kw):
    model.zero_grad()
    logits = model(batch["input_ids"], **kw)
    loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(),
                           ignore_index=-100, reduction="sum")
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_packed_rows_equal_the_unpacked_batch(tmp_path, tokenizer):
    seq = 160
    ds = SFTDataset(_sft_file(tmp_path / "s.jsonl", n=30), tokenizer, "llama3", seq, seed=1,
                    pack=True)
    ks = [k for k in range(ds.rows_in_epoch(0)) if len(ds.samples_of(k)) >= 3][:2]
    assert len(ks) == 2
    packed = collate([ds[k] for k in ks], ks)
    assert packed["segments"].shape == (2, seq)
    members = [i for k in ks for i in ds.samples_of(k)]
    unpacked = collate([sft_row([ds.sample(i)], seq, tokenizer.pad_id, packed=False)
                        for i in members], members)
    assert "segments" not in unpacked
    assert int((packed["labels"] != -100).sum()) == int((unpacked["labels"] != -100).sum())
    model = fp64_llama(tokenizer.vocab_size, max_seq_len=256)
    loss_p, grads_p = _loss_and_grads(model, packed, positions=packed["positions"],
                                      mask=DocumentMask(packed["segments"]))
    loss_u, grads_u = _loss_and_grads(model, unpacked)
    torch.testing.assert_close(loss_p, loss_u, rtol=1e-10, atol=1e-10)
    for name in grads_p:
        torch.testing.assert_close(grads_p[name], grads_u[name], rtol=1e-8, atol=1e-10,
                                   msg=name)
