"""Valid but odd JSON: what json.loads accepts but is no text to train on (a lone
surrogate, nesting deeper than Python's reader goes, an integer longer than Python
converts) is a reason with the field at fault, which every reader reports with file:line
and preprocess's skip mode skips and counts; a blank answer under a chat template that
trims the content is an empty answer (skipped and counted), not a template refusal."""
from __future__ import annotations

import gzip
import json

import pytest

from helpers.preference_data import model_dir
from lmforge.data.errors import DataError
from lmforge.data.preprocess import preprocess
from lmforge.data.readers import iter_record_texts
from lmforge.data.records import BadRecord, iter_jsonl, parse_record
from lmforge.data.sft import SFTDataset
from lmforge.data.tokenizer import load_tokenizer

SURROGATE = "holds a lone surrogate (\\ud800), which is not valid Unicode text"


@pytest.mark.parametrize("raw,reason", [
    ('{"text": "a\\ud800b"}', f"field 'text' {SURROGATE}"),
    ('{"messages": [{"content": "ok"}, {"role": "x", "content": "\\ud800"}]}',
     f"field 'messages[1].content' {SURROGATE}"),
    ('{"meta": {"url": "\\ud800"}, "text": "ok"}', f"field 'meta.url' {SURROGATE}"),
    ('"\\ud800"', f"the record {SURROGATE}"),
    ('{"\\ud800": 1}', "the key '\\ud800' holds a lone surrogate"),
    ('{"text": ' + "[" * 5000 + "]" * 5000 + "}",
     "unreadable JSON (nested too deeply for Python's JSON reader)"),
    ('{"text": ' + "1" * 4301 + "}", "unreadable JSON (an integer of more than 4300 digits)"),
])
def test_json_that_is_no_text_is_a_reason_naming_the_field(raw, reason):
    with pytest.raises(BadRecord) as err:
        parse_record(raw.encode())
    assert str(err.value).startswith(reason)


def test_a_surrogate_pair_is_one_character_and_an_escaped_backslash_no_surrogate():
    assert parse_record(b'{"text": "\\ud83d\\ude00 \\\\ud800"}') == {"text": "\U0001F600 \\ud800"}


def test_every_jsonl_and_json_array_reader_names_file_and_line(tmp_path):
    lines = tmp_path / "a.jsonl"
    lines.write_text('{"text": "ok"}\n\n{"text": "\\ud800"}\n')
    with pytest.raises(DataError, match=rf"^{lines}:3: field 'text' holds a lone surrogate"):
        list(iter_jsonl(lines))
    with pytest.raises(DataError, match=rf"^{lines}:3: field 'text' holds a lone surrogate"):
        list(iter_record_texts(lines, ["text"]))
    array = tmp_path / "a.json"
    array.write_text('[{"text": "ok"},\n {"body": "\\udc00", "text": "x"}]')
    with pytest.raises(DataError, match=rf"^{array}:2: field 'body' holds a lone surrogate"):
        list(iter_record_texts(array, ["text"]))


def test_a_cut_gzip_file_is_refused_naming_it(tmp_path):
    path = tmp_path / "a.jsonl.gz"
    whole = gzip.compress("".join(json.dumps({"text": f"t{i}"}) + "\n"
                                  for i in range(500)).encode())
    path.write_bytes(whole[:len(whole) // 2])
    with pytest.raises(DataError, match=rf"^{path}: cannot read \(Compressed file ended"):
        list(iter_jsonl(path))


def test_preprocess_skip_mode_skips_and_locates_records_that_are_no_text(tmp_path,
                                                                        tokenizer_dir):
    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n{"text": "\\ud800"}\n'
                                      '{"text": "two"}\n')
    (tmp_path / "b.json").write_text('[{"text": "three"},\n{"text": "x\\udfff"}]')
    inputs = [tmp_path / "a.jsonl", tmp_path / "b.json"]
    stats = preprocess(inputs, tmp_path / "p", tokenizer_dir, on_error="skip", workers=2)
    assert stats.documents == 3 and stats.skipped == 2
    assert "a.jsonl:2: field 'text'" in stats.summary()
    assert "b.json:2: field 'text'" in stats.summary()


def test_a_parquet_string_that_is_not_utf8_is_a_bad_row(tmp_path, tokenizer_dir):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    column = pa.array([b"good", b"\xffbad", b"fine"], pa.binary()).view(pa.string())
    pq.write_table(pa.table({"text": column}), tmp_path / "a.parquet")
    reason = r"field 'text' is not valid UTF-8 \(byte 0xff at byte 1\)"
    with pytest.raises(DataError, match=rf"a\.parquet:2: {reason}"):
        list(iter_record_texts(tmp_path / "a.parquet", ["text"]))
    stats = preprocess([tmp_path / "a.parquet"], tmp_path / "p", tokenizer_dir,
                       on_error="skip")
    assert stats.documents == 2 and stats.skipped == 1


def test_a_blank_answer_under_a_trimming_template_is_skipped_as_empty(tmp_path):
    model = model_dir(tmp_path)  # ChatML whose template trims each message's content
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [
        {"prompt": "hi", "response": "hello"}, {"prompt": "hi", "response": " \n "},
        {"prompt": "yo", "response": "hey"}]))
    ds = SFTDataset(path, load_tokenizer(model), "auto", 64, cache_dir=tmp_path / "cache")
    assert ds.rows.tolist() == [0, 2] and ds.empty_answers == 1
