"""Raw-text corpora (data.kind=text): the train/held-out split works for any number of
files, and too little text is refused with what to change; records are read as preprocess
reads them, and a bad or empty corpus is refused naming the field and the place."""
import json
import zlib

import numpy as np
import torch
import pytest

from lmforge.config import load_config
from lmforge.data.build import build_data, check_data, corpus_texts_for_tokenizer
from lmforge.data.errors import DataError
from lmforge.data.text import split_files, tokenize_files
from lmforge.data.windows import TokenWindows

from .conftest import make_docs, write_jsonl

HELD_OUT_NAME = "notes16.txt"  # its name hashes into the 5% held-out share


def test_the_name_used_below_hashes_into_the_held_out_share():
    assert zlib.crc32(HELD_OUT_NAME.encode()) % 10_000 < 500


def test_a_single_file_corpus_trains_on_its_head_and_holds_out_its_tail(tmp_path, tokenizer):
    corpus = tmp_path / HELD_OUT_NAME
    corpus.write_text("\n\n".join(make_docs(60, seed=4)))
    cfg = load_config(None, ["data.kind=text", f"data.path={corpus}", "data.seq_len=32",
                             "data.micro_batch_size=2"])
    assert split_files([corpus], 0.05) == ([corpus], [])
    assert list(corpus_texts_for_tokenizer(cfg)) == [corpus.read_text()]
    bundle = build_data(cfg, tokenizer)
    everything = tokenize_files([corpus], tokenizer)
    train = bundle.train.dataset.tokens
    assert bundle.train.dataset.num_samples >= 2 and bundle.eval_batches is not None
    held = next(iter(bundle.eval_batches()))["input_ids"]
    assert len(train) < len(everything) and np.array_equal(train, everything[:len(train)])
    tail = everything[len(train):]
    assert len(tail) == int(0.05 * len(everything))
    assert np.array_equal(held[0].numpy(), tail[:32]), "held out = the tail, not trained on"
    assert "held out" in bundle.description


def test_a_corpus_with_just_one_batch_trains_on_all_of_it(tmp_path, tokenizer):
    corpus = tmp_path / HELD_OUT_NAME
    corpus.write_text(make_docs(1, seed=5)[0])
    tokens = len(tokenize_files([corpus], tokenizer))
    cfg = load_config(None, ["data.kind=text", f"data.path={corpus}", "data.micro_batch_size=2",
                             f"data.seq_len={(tokens - 1) // 2}"])  # exactly two windows
    bundle = build_data(cfg, tokenizer)
    assert len(bundle.train.dataset.tokens) == tokens and bundle.eval_batches is None


def test_too_few_tokens_for_one_batch_are_refused_with_what_to_change():
    with pytest.raises(ValueError, match=r"^data: 0 tokens make 0 windows of data.seq_len=256"
                                         r", fewer than one batch of 8 .*data.seq_len"):
        TokenWindows([np.zeros(0, np.int32)], 256, seed=0, epoch_multiple=8)


def test_data_parallel_ranks_share_the_held_out_windows_in_equal_numbers_of_batches(
        tmp_path, tokenizer):
    held_out = tmp_path / "held.txt"
    held_out.write_text(make_docs(1, seed=6, min_words=42, max_words=42)[0])
    assert (len(tokenize_files([held_out], tokenizer)) - 1) // 32 == 5  # windows
    corpus = tmp_path / "train.txt"
    corpus.write_text("\n\n".join(make_docs(60, seed=4)))
    cfg = load_config(None, ["data.kind=text", f"data.path={corpus}", "data.seq_len=32",
                             f"data.eval_path={held_out}", "data.micro_batch_size=2"])
    one = list(build_data(cfg, tokenizer).eval_batches())  # rows 2, 2, 1
    assert [len(b["labels"]) for b in one] == [2, 2, 1]
    ranks = [list(build_data(cfg, tokenizer, r, 2).eval_batches()) for r in (0, 1)]
    assert [len(batches) for batches in ranks] == [2, 2]  # the same number of passes
    dealt = [ranks[0][0], ranks[1][0], ranks[0][1]]  # batch k on rank k % 2
    assert all(torch.equal(a[k], b[k]) for a, b in zip(one, dealt)
               for k in ("input_ids", "labels"))
    assert (ranks[1][1]["labels"] == -100).all()  # rank 1's second: no targets
    cfg.train.eval_batches = 1  # per rank: the two ranks score the one process's first two
    firsts = [list(build_data(cfg, tokenizer, r, 2).eval_batches()) for r in (0, 1)]
    assert [len(b) for b in firsts] == [1, 1]
    assert torch.equal(firsts[1][0]["labels"], one[1]["labels"])


def test_a_jsonl_corpus_trains_on_its_records_texts_and_leaves_out_empty_ones(
        tmp_path, tokenizer):
    docs = make_docs(30, seed=7)
    records = [{"body": d, "id": i} for i, d in enumerate(docs)]
    records[3]["body"] = records[9]["body"] = ""  # no text: no document (not a lone EOS)
    corpus = write_jsonl(tmp_path / "c.jsonl", records)
    cfg = load_config(None, ["data.kind=text", f"data.path={corpus}", "data.json_key=body",
                             "data.seq_len=16", "data.micro_batch_size=2",
                             "data.eval_fraction=0"])
    kept = [d for i, d in enumerate(docs) if i not in (3, 9)]
    expected = np.concatenate([tokenizer.encode(d) + tokenizer.eos_ids for d in kept])
    assert np.array_equal(build_data(cfg, tokenizer).train.dataset.tokens, expected)
    assert list(corpus_texts_for_tokenizer(cfg)) == kept


NOT_UTF8 = bytes(range(128, 256)) * 160  # 20 KB that no UTF-8 decoder accepts
BAD_CORPORA = {
    "random bytes": ("noise.bin", NOT_UTF8,
                     r"^data\.path: .*noise\.bin:1: not valid UTF-8 \(byte 0x80 at byte "
                     r"offset 0"),
    "bytes after text": ("late.txt", b"fine\nstill fine\n\xff",
                         r"^data\.path: .*late\.txt:3: not valid UTF-8 \(byte 0xff at byte "
                         r"offset 16"),
    "broken JSON line": ("broken.jsonl", b'{"text": "ok"}\n{"text": "cut\n',
                         r"^data\.path: .*broken\.jsonl:2: not valid JSON"),
    "only empty texts": ("empty.jsonl", b'{"text": ""}\n{"text": " "}\n',
                         r"^data\.path: .*empty\.jsonl: no text to train on"),
}


@pytest.mark.parametrize("case", sorted(BAD_CORPORA))
def test_a_bad_or_empty_corpus_is_refused_naming_the_field_and_the_place(
        tmp_path, tokenizer, case):
    name, content, message = BAD_CORPORA[case]
    (tmp_path / name).write_bytes(content)
    cfg = load_config(None, ["data.kind=text", f"data.path={tmp_path / name}",
                             "data.seq_len=16", "data.micro_batch_size=2"])
    with pytest.raises(DataError, match=message) as refused:
        check_data(cfg)
    assert "\n" not in str(refused.value)
    with pytest.raises(ValueError):  # building the data reads it the same way
        build_data(cfg, tokenizer)


def test_an_eval_path_without_text_is_refused_naming_it(tmp_path):
    corpus, held = tmp_path / "train.txt", tmp_path / "held.jsonl"
    corpus.write_text("\n\n".join(make_docs(60, seed=4)))
    held.write_text(json.dumps({"text": ""}) + "\n")
    cfg = load_config(None, ["data.kind=text", f"data.path={corpus}",
                             f"data.eval_path={held}"])
    with pytest.raises(DataError, match=r"^data\.eval_path: .*held\.jsonl: no text"):
        check_data(cfg)
