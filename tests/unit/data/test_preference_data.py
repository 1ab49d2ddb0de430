"""Preference pairs: TRL's three record formats render with the model's own chat template
as transformers renders them, labels cover the completion only, length limits cut as TRL
does (prompt from the left, completion from the right) and are counted, bad records are
refused naming file:line and the field at fault, pairs with the same completions or an
empty (or blank) one are skipped and counted (a file of nothing but empty ones is
refused), and a packed batch keeps each sequence's labels in its own slot."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from helpers.preference_data import model_dir, pairs, write_pairs
from lmforge import IGNORE_INDEX
from lmforge.data.errors import DataError
from lmforge.data.preference import PreferenceDataset, check_some_pair
from lmforge.data.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return model_dir(tmp_path_factory.mktemp("pref"))


def dataset(model, path, tmp_path, **kw):
    kw = {"seq_len": 64, "cache_dir": tmp_path / "cache", **kw}
    return PreferenceDataset(path, load_tokenizer(model), "auto", **kw)


def test_every_format_renders_as_transformers_apply_chat_template_with_completion_labels(
        model, tmp_path):
    transformers = pytest.importorskip("transformers")
    hf_tok = transformers.AutoTokenizer.from_pretrained(model)
    records = pairs(3)  # one of each format, the same rule
    ds = dataset(model, write_pairs(tmp_path / "p.jsonl", records), tmp_path)
    tok = load_tokenizer(model)
    for i, record in enumerate(records):
        user = record["prompt"] if isinstance(record.get("prompt"), str) else None
        for side in (0, 1):
            key = ("chosen", "rejected")[side]
            completion = record[key] if isinstance(record[key], str) else \
                record[key][-1]["content"]
            prompt = user or (record.get("prompt") or record[key][:-1])
            messages = ([{"role": "user", "content": prompt}] if isinstance(prompt, str)
                        else list(prompt)) + [{"role": "assistant", "content": completion}]
            expected = hf_tok.apply_chat_template(messages, tokenize=True)
            expected = expected["input_ids"] if hasattr(expected, "keys") else expected
            ids, flags = ds.sequence(i, side)
            assert ids.tolist() == list(expected)
            assert tok.decode(ids[flags].tolist(), skip_special=False) == \
                completion + "<|im_end|>"


def test_a_batch_holds_the_chosen_rows_then_the_rejected_with_labels_on_completions(
        model, tmp_path):
    ds = dataset(model, write_pairs(tmp_path / "p.jsonl", pairs(6)), tmp_path,
                 pad_to_multiple_of=8)
    batch = ds.pair_batch([4, 1])
    assert batch["n_pairs"] == 2 and batch["input_ids"].shape[0] == 4
    assert batch["input_ids"].shape[1] % 8 == 0
    for row, (pair, side) in enumerate([(4, 0), (1, 0), (4, 1), (1, 1)]):
        ids, flags = ds.sequence(pair, side)
        labels = batch["labels"][row]
        assert labels[labels != IGNORE_INDEX].tolist() == ids[1:][flags[1:]].tolist()
        assert set(batch["slots"][row][labels != IGNORE_INDEX].tolist()) == {row}
        assert (batch["slots"][row][labels == IGNORE_INDEX] == -1).all()


def test_a_packed_row_holds_whole_pairs_each_sequence_in_its_own_slot_and_segment(
        model, tmp_path):
    path = write_pairs(tmp_path / "p.jsonl", pairs(12))
    plain = dataset(model, path, tmp_path)
    packed = dataset(model, path, tmp_path, pack=True)
    batch = packed.batch([0, 1])
    n = batch["n_pairs"]
    assert n == len(packed.samples_of(0)) + len(packed.samples_of(1)) and n > 2
    assert batch["input_ids"].shape == (2, 2 * packed.seq_len)
    order = batch["sample_ids"].tolist()
    for slot in range(2 * n):
        pair, side = order[slot % n], slot // n
        ids, flags = plain.sequence(pair, side)
        where = batch["slots"] == slot
        assert batch["labels"][where].tolist() == ids[1:][flags[1:]].tolist()
    segments = batch["segments"][0]
    assert segments.diff().ge(0).all() and len(segments.unique()) >= 2  # a block per sequence


def test_length_limits_cut_as_trl_does_and_are_counted(model, tmp_path):
    long_prompt = " ".join(["the sky"] * 30)
    records = [{"prompt": long_prompt, "chosen": "the the", "rejected": "blue"},
               {"prompt": "hi", "chosen": " ".join(["sea"] * 40), "rejected": "no"},
               {"prompt": long_prompt * 3, "chosen": "a", "rejected": "b"},
               *pairs(4)]
    with pytest.warns(UserWarning, match="skipped"):
        ds = dataset(model, write_pairs(tmp_path / "q.jsonl", records), tmp_path,
                     seq_len=20, max_prompt_len=None)
    assert ds.skipped_pairs >= 1 and 2 not in ds.rows.tolist()
    ds = dataset(model, write_pairs(tmp_path / "r.jsonl", records), tmp_path,
                 seq_len=48, max_prompt_len=24)
    assert ds.truncated_prompts >= 2 and ds.truncated_completions >= 1
    ids, flags = ds.sequence(0, 0)  # the prompt keeps its last 24 tokens
    whole = ds.tokens[0].tolist()
    assert ids.tolist() == whole[len(whole) - len(ids):] and flags.sum() > 0
    assert int(np.flatnonzero(flags)[0]) == 24
    ids, flags = ds.sequence(1, 0)  # a long completion keeps its start
    assert len(ids) == 49 and flags[-1]
    notes, stats = ds.report()
    assert stats["preference_truncated_prompts"] == ds.truncated_prompts
    assert "data.max_prompt_len" in notes[0]


@pytest.mark.parametrize("record,message", [
    ({"prompt": "hi", "chosen": "a"}, "missing key 'rejected'"),
    ({"prompt": [{"role": "user", "content": "hi"}],
      "chosen": [{"role": "user", "content": "a"}],
      "rejected": [{"role": "assistant", "content": "b"}]},
     "'chosen' must end with an assistant message"),
    ({"prompt": "hi", "chosen": "a", "rejected": 3}, "'rejected' must be a string, as "
     "'prompt' is"),
    ({"chosen": "a", "rejected": "b"}, "missing key 'prompt'"),
    ({"prompt": "hi", "system": 3, "chosen": "a", "rejected": "b"},
     "'system' must be a string"),
    ({"prompt": [{"role": "user"}], "chosen": [{"role": "assistant", "content": "a"}],
      "rejected": [{"role": "assistant", "content": "b"}]},
     "'prompt' message 1 needs a string 'content'"),
    ({"prompt": [{"role": "user", "content": "q"}],
      "chosen": [{"role": "assistant", "content": "a"}],
      "rejected": [{"role": "assistant", "content": "b"}, {"role": "tool", "content": "c"},
                   {"role": "assistant", "content": "d"}]},
     "'rejected' message 2 has role 'tool'"),
    ({"chosen": [{"role": "user", "content": "q"}, {"role": "user", "content": "q"},
                 {"role": "assistant", "content": "a"}],
      "rejected": [{"role": "user", "content": "q"}, {"role": "user", "content": "q"},
                   {"role": "assistant", "content": "b"}]},
     "'prompt' message 2 is 'user', expected 'assistant'"),
    ({"chosen": [{"role": "assistant", "content": "a"}],
      "rejected": [{"role": "assistant", "content": "b"}]}, "share no prompt message"),
])
def test_a_bad_record_is_refused_naming_file_and_line(model, tmp_path, record, message):
    path = write_pairs(tmp_path / "p.jsonl", [*pairs(2), record])
    with pytest.raises(DataError, match=rf"{path}:3: .*{message}"):
        dataset(model, path, tmp_path)


def test_pairs_with_the_same_completions_are_skipped_and_counted(model, tmp_path):
    same = {"prompt": "hi", "chosen": "hello", "rejected": "hello"}
    path = write_pairs(tmp_path / "p.jsonl", [*pairs(4), same])
    with pytest.warns(UserWarning, match="1 pairs skipped for the same chosen"):
        ds = dataset(model, path, tmp_path)
    assert ds.same_completions == 1 and 4 not in ds.rows.tolist() and len(ds) == 4


def _empty_in_each_format(blank: str) -> list[dict]:
    """A pair with an empty (or blank) completion in each of TRL's three formats."""
    user = {"role": "user", "content": "hi"}
    return [{"prompt": "hi", "chosen": blank, "rejected": "no"},
            {"prompt": [user], "chosen": [{"role": "assistant", "content": "yes"}],
             "rejected": [{"role": "assistant", "content": blank}]},
            {"chosen": [user, {"role": "assistant", "content": blank}],
             "rejected": [user, {"role": "assistant", "content": "no"}]}]


@pytest.mark.parametrize("blank", ["", " \n\t"])
def test_pairs_with_an_empty_or_blank_completion_are_skipped_and_counted_in_every_format(
        model, tmp_path, blank):
    both = {"prompt": "hi", "chosen": blank, "rejected": blank}  # empty, not "the same"
    path = write_pairs(tmp_path / "p.jsonl", [*pairs(4), *_empty_in_each_format(blank), both])
    with pytest.warns(UserWarning, match="4 for an empty one"):
        ds = dataset(model, path, tmp_path)
    assert ds.empty_completions == 4 and ds.same_completions == 0
    assert ds.rows.tolist() == [0, 1, 2, 3]
    notes, stats = ds.report()
    assert stats["preference_empty_completions"] == 4
    assert "4 with an empty chosen or rejected" in notes[0]


def test_a_file_of_empty_completions_only_is_refused_before_a_run_and_by_the_dataset(
        model, tmp_path):
    path = write_pairs(tmp_path / "p.jsonl", _empty_in_each_format(""))
    message = r"every pair has an empty chosen or rejected completion \(3 pairs\)"
    with pytest.raises(DataError, match=rf"^data\.path: {path}: {message}"):
        check_some_pair("data.path", path)
    with pytest.raises(DataError, match=rf"^{path}: {message}"):
        dataset(model, path, tmp_path)
    # a usable pair after empty ones: the check reads on to it, and stops there
    write_pairs(path, [*_empty_in_each_format(""), pairs(1)[0], "not a record"])
    check_some_pair("data.path", path)


def test_held_out_pairs_are_a_fixed_share_apart_from_the_training_ones(model, tmp_path):
    path = write_pairs(tmp_path / "p.jsonl", pairs(40))
    train = dataset(model, path, tmp_path, holdout=("train", 0.1))
    held = dataset(model, path, tmp_path, holdout=("eval", 0.1))
    assert len(held) == 4 and len(train) == 36
    assert not set(train.rows.tolist()) & set(held.rows.tolist())
