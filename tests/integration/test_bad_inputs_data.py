"""Bad-input rows of the data readers (the harness: tests/helpers/bad_inputs.py).

Preference pairs are held to SFT's rules: a pair with an empty (or blank) chosen or
rejected completion would train the model to prefer (or avoid) silence, so a file of
nothing else is refused, in every record format the reader accepts, for data.path,
data.eval_path and ``lmforge eval --objective``; a bad record names the field at fault.

Valid but odd JSON: a lone surrogate (``"\\ud800"``, which json.loads accepts and no UTF-8
encoder does), nesting deeper than Python's JSON reader goes, or an integer too long to
convert is refused with file:line by every reader (training data of each kind, eval,
eval-sft, preprocess and its worker processes, tokenizer train), never a traceback.
"""
from __future__ import annotations

import gzip
import json

import pytest

from helpers.bad_inputs import Bad, check_refused, params, steps, write

PAIRS = ["train", "model.init_from={model}", "data.kind=preference",
         "data.path={tmp}/pairs.jsonl", "data.seq_len=64", "train.output_dir={tmp}/run"]
EVAL_PAIRS = ["eval", "--model", "{model}", "--reference", "{model}", "--objective", "dpo",
              "--data", "{tmp}/pairs.jsonl"]
SFT = ["train", "model.init_from={model}", "data.kind=sft", "data.path={tmp}/chat.jsonl",
       "data.seq_len=64", "train.output_dir={tmp}/run"]
TEXT = ["train", "data.kind=text", "data.path={tmp}/c.jsonl", "train.output_dir={tmp}/run"]
GOOD_PAIR = {"prompt": "hi", "chosen": "hello there", "rejected": "go away"}


def jsonl(*records) -> str:
    """Records as JSON Lines; a str record is written as it is (raw JSON text)."""
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def pairs_file(*records, name="pairs.jsonl"):
    return write(name, jsonl(*records))


EMPTY = r"every pair has an empty chosen or rejected completion \(3 pairs\): nothing to train on"
# A lone surrogate, as JSON writes it (json.dumps escapes it so; the file is valid UTF-8).
LONE = r"\ud800"
SURROGATE = r"holds a lone surrogate \(\\ud800\), which is not valid Unicode text"

PREFERENCE = [
    Bad("preference file whose every chosen is empty", PAIRS,
        rf"^data\.path: {{tmp}}/pairs\.jsonl: {EMPTY}",
        setup=pairs_file(*[{"prompt": f"q{i}", "chosen": "", "rejected": "no"}
                           for i in range(3)])),
    Bad("preference file whose every rejected is blank", PAIRS,
        rf"^data\.path: {{tmp}}/pairs\.jsonl: {EMPTY}",
        setup=pairs_file(*[{"prompt": f"q{i}", "chosen": "yes", "rejected": " \n\t"}
                           for i in range(3)])),
    Bad("preference message lists whose every chosen is empty", PAIRS,
        rf"^data\.path: {{tmp}}/pairs\.jsonl: {EMPTY}",
        setup=pairs_file(*[{"prompt": [user(f"q{i}")], "chosen": [assistant("")],
                            "rejected": [assistant("no")]} for i in range(3)])),
    Bad("preference conversations whose every rejected is empty", PAIRS,
        rf"^data\.path: {{tmp}}/pairs\.jsonl: {EMPTY}",
        setup=pairs_file(*[{"chosen": [user(f"q{i}"), assistant("yes")],
                            "rejected": [user(f"q{i}"), assistant("")]} for i in range(3)])),
    Bad("preference eval_path of empty completions",
        [*PAIRS, "data.eval_path={tmp}/held.jsonl"],
        rf"^data\.eval_path: {{tmp}}/held\.jsonl: {EMPTY}",
        setup=steps(pairs_file(GOOD_PAIR),
                    pairs_file(*[{"prompt": "q", "chosen": "", "rejected": ""}] * 3,
                               name="held.jsonl"))),
    Bad("eval --objective on pairs of empty completions", EVAL_PAIRS,
        rf"^{{tmp}}/pairs\.jsonl: {EMPTY}",
        setup=pairs_file(*[{"prompt": f"q{i}", "chosen": "", "rejected": "no"}
                           for i in range(3)])),
    Bad("preference prompt message without content", PAIRS,
        r"^{tmp}/pairs\.jsonl:1: 'prompt' message 1 needs a string 'content'",
        setup=pairs_file({"prompt": [{"role": "user", "content": 3}],
                          "chosen": [assistant("a")], "rejected": [assistant("b")]})),
    Bad("preference prompt message of an unknown role", EVAL_PAIRS,
        r"^{tmp}/pairs\.jsonl:2: 'prompt' message 1 has role 'bot'",
        setup=pairs_file(GOOD_PAIR, {"prompt": [{"role": "bot", "content": "x"}],
                                     "chosen": [assistant("a")],
                                     "rejected": [assistant("b")]})),
    Bad("preference rejected message out of turn", PAIRS,
        r"^{tmp}/pairs\.jsonl:1: 'rejected' message 1 is 'user', expected 'assistant'",
        setup=pairs_file({"prompt": [user("q")], "chosen": [assistant("a")],
                          "rejected": [user("b"), assistant("c")]})),
    Bad("preference conversation prompt message out of turn", PAIRS,
        r"^{tmp}/pairs\.jsonl:1: 'prompt' message 2 is 'user', expected 'assistant'",
        setup=pairs_file({"chosen": [user("q"), user("q2"), assistant("a")],
                          "rejected": [user("q"), user("q2"), assistant("b")]})),
    Bad("preference system that is not a string", PAIRS,
        r"^{tmp}/pairs\.jsonl:1: 'system' must be a string",
        setup=pairs_file({"system": ["be brief"], **GOOD_PAIR})),
    Bad("preference string completions without a prompt", PAIRS,
        r"^{tmp}/pairs\.jsonl:1: missing key 'prompt'",
        setup=pairs_file({"chosen": "a", "rejected": "b"})),
]

# valid JSON that Python's reader refuses: nested past its recursion limit, or an integer
# of more digits than it converts
DEEP = '{"text": ' + "[" * 100_000 + "]" * 100_000 + "}"
LONG_INT = '{"text": ' + "9" * 5000 + "}"

ODD_JSON = [
    Bad("preference chosen with a lone surrogate", PAIRS,
        rf"^{{tmp}}/pairs\.jsonl:1: field 'chosen' {SURROGATE}",
        setup=write("pairs.jsonl", '{"prompt": "hi", "chosen": "a' + LONE
                    + '", "rejected": "b"}\n')),
    Bad("preference prompt message with a lone surrogate", EVAL_PAIRS,
        rf"^{{tmp}}/pairs\.jsonl:2: field 'prompt\[0\]\.content' {SURROGATE}",
        setup=write("pairs.jsonl", jsonl(GOOD_PAIR, '{"prompt": [{"role": "user", '
                    '"content": "' + LONE + '"}], "chosen": [{"role": "assistant", '
                    '"content": "a"}], "rejected": [{"role": "assistant", "content": "b"}]}'))),
    Bad("preference eval_path with a lone surrogate",
        [*PAIRS, "data.eval_path={tmp}/held.jsonl"],
        rf"^{{tmp}}/held\.jsonl:1: field 'rejected' {SURROGATE}",
        setup=steps(pairs_file(GOOD_PAIR),
                    write("held.jsonl", '{"prompt": "hi", "chosen": "a", "rejected": "'
                          + LONE + '"}\n'))),
    Bad("SFT prompt with a lone surrogate", SFT,
        rf"^{{tmp}}/chat\.jsonl:1: field 'prompt' {SURROGATE}",
        setup=write("chat.jsonl", '{"prompt": "' + LONE + '", "response": "a"}\n')),
    Bad("SFT eval_path with a lone surrogate in a message",
        [*SFT, "data.eval_path={tmp}/held.jsonl"],
        rf"^{{tmp}}/held\.jsonl:1: field 'messages\[1\]\.content' {SURROGATE}",
        setup=steps(write("chat.jsonl", jsonl({"prompt": "hi", "response": "a"})),
                    write("held.jsonl", '{"messages": [{"role": "user", "content": "hi"}, '
                          '{"role": "assistant", "content": "x' + LONE + '"}]}\n'))),
    Bad("SFT record with a lone surrogate in a key", SFT,
        r"^{tmp}/chat\.jsonl:1: the key '\\ud800' holds a lone surrogate",
        setup=write("chat.jsonl", '{"prompt": "hi", "response": "a", "' + LONE + '": 1}\n')),
    Bad("text corpus record with a lone surrogate", TEXT,
        rf"^data\.path: {{tmp}}/c\.jsonl:2: field 'text' {SURROGATE}",
        setup=write("c.jsonl", jsonl({"text": "fine"}, '{"text": "' + LONE + '"}'))),
    Bad("text corpus array with a lone surrogate",
        ["train", "data.kind=text", "data.path={tmp}/c.json", "train.output_dir={tmp}/run"],
        rf"^data\.path: {{tmp}}/c\.json:3: field 'text' {SURROGATE}",
        setup=write("c.json", '[{"text": "fine"},\n\n {"text": "' + LONE + '"}]\n')),
    Bad("text corpus nested too deeply", TEXT,
        r"^data\.path: {tmp}/c\.jsonl:1: unreadable JSON \(nested too deeply",
        setup=write("c.jsonl", DEEP + "\n")),
    Bad("text corpus with an integer too long", TEXT,
        r"^data\.path: {tmp}/c\.jsonl:1: unreadable JSON \(an integer of more than 4300 digits",
        setup=write("c.jsonl", LONG_INT + "\n")),
    Bad("eval of text records with a lone surrogate",
        ["eval", "--model", "{model}", "--data", "{tmp}/d.jsonl", "--json-key", "body"],
        rf"^{{tmp}}/d\.jsonl:2: field 'body' {SURROGATE}",
        setup=write("d.jsonl", jsonl({"body": "fine"}, '{"body": "a' + LONE + 'b"}'))),
    Bad("eval of chat records with a lone surrogate",
        ["eval", "--model", "{model}", "--data", "{tmp}/d.jsonl"],
        rf"^{{tmp}}/d\.jsonl:1: field 'response' {SURROGATE}",
        setup=write("d.jsonl", '{"prompt": "hi", "response": "' + LONE + '"}\n')),
    Bad("eval of records nested too deeply",
        ["eval", "--model", "{model}", "--data", "{tmp}/d.jsonl"],
        r"^{tmp}/d\.jsonl:1: unreadable JSON \(nested too deeply",
        setup=write("d.jsonl", DEEP + "\n")),
    Bad("eval-sft data with a lone surrogate",
        ["eval-sft", "--model", "{model}", "--data", "{tmp}/d.jsonl", "--output",
         "{tmp}/r.json"],
        rf"^{{tmp}}/d\.jsonl:2: field 'response' {SURROGATE}",
        setup=write("d.jsonl", jsonl({"prompt": "hi", "response": "a"},
                                     '{"prompt": "hi", "response": "' + LONE + '"}'))),
    Bad("lora eval data with a lone surrogate",
        ["lora", "eval", "--model", "{model}", "--data", "{tmp}/d.jsonl", "--output",
         "{tmp}/r.json"],
        rf"^{{tmp}}/d\.jsonl:1: field 'prompt' {SURROGATE}",
        setup=write("d.jsonl", '{"prompt": "' + LONE + '", "response": "a"}\n')),
    Bad("eval-sft data that is not UTF-8",
        ["eval-sft", "--model", "{model}", "--data", "{tmp}/d.jsonl", "--output",
         "{tmp}/r.json"],
        r"^{tmp}/d\.jsonl:2: not valid UTF-8 \(byte 0xff",
        setup=write("d.jsonl", b'{"prompt": "hi", "response": "a"}\n'
                    b'{"prompt": "\xff", "response": "a"}\n')),
    Bad("preprocess record with a lone surrogate in a worker",
        ["preprocess", "--input", "{tmp}/c.jsonl", "--output-prefix", "{tmp}/p",
         "--tokenizer", "{tokenizer}", "--workers", "2"],
        rf"^{{tmp}}/c\.jsonl:3: field 'text' {SURROGATE}",
        setup=write("c.jsonl", jsonl({"text": "a"}, {"text": "b"},
                                     '{"text": "' + LONE + '"}'))),
    Bad("preprocess record with a lone surrogate in the main process",
        ["preprocess", "--input", "{tmp}/c.jsonl", "--output-prefix", "{tmp}/p",
         "--tokenizer", "{tokenizer}"],
        rf"^{{tmp}}/c\.jsonl:1: field 'text' {SURROGATE}",
        setup=write("c.jsonl", '{"text": "' + LONE + '"}\n')),
    Bad("preprocess array record with a lone surrogate",
        ["preprocess", "--input", "{tmp}/c.json", "--output-prefix", "{tmp}/p",
         "--tokenizer", "{tokenizer}", "--workers", "2"],
        rf"^{{tmp}}/c\.json:2: field 'text' {SURROGATE}",
        setup=write("c.json", '[{"text": "a"},\n {"text": "' + LONE + '"}]\n')),
    Bad("preprocess record nested too deeply in a worker",
        ["preprocess", "--input", "{tmp}/c.jsonl", "--output-prefix", "{tmp}/p",
         "--tokenizer", "{tokenizer}", "--workers", "2"],
        r"^{tmp}/c\.jsonl:2: unreadable JSON \(nested too deeply",
        setup=write("c.jsonl", jsonl({"text": "a"}, DEEP))),
    Bad("preprocess array nested too deeply",
        ["preprocess", "--input", "{tmp}/c.json", "--output-prefix", "{tmp}/p",
         "--tokenizer", "{tokenizer}"],
        r"^{tmp}/c\.json:1: unreadable JSON \(nested too deeply",
        setup=write("c.json", "[" + DEEP + "]\n")),
    Bad("tokenizer train on a record with a lone surrogate",
        ["tokenizer", "train", "--input", "{tmp}/c.jsonl", "--vocab-size", "300",
         "--output", "{tmp}/tok"],
        rf"^{{tmp}}/c\.jsonl:2: field 'text' {SURROGATE}",
        setup=write("c.jsonl", jsonl({"text": "fine"}, '{"text": "' + LONE + '"}'))),
    Bad("tokenizer train on an array with a lone surrogate",
        ["tokenizer", "train", "--input", "{tmp}/c.json", "--vocab-size", "300",
         "--output", "{tmp}/tok"],
        rf"^{{tmp}}/c\.json:1: field 'text' {SURROGATE}",
        setup=write("c.json", '[{"text": "' + LONE + '"}]\n')),
    Bad("tokenizer train on an integer too long",
        ["tokenizer", "train", "--input", "{tmp}/c.jsonl", "--vocab-size", "300",
         "--output", "{tmp}/tok"],
        r"^{tmp}/c\.jsonl:1: unreadable JSON \(an integer of more than 4300 digits",
        setup=write("c.jsonl", LONG_INT + "\n")),
    # Python hands a command line's bytes that are not UTF-8 on as lone surrogates.
    Bad("generate prompt that is not UTF-8",
        ["generate", "--model", "{model}", "--prompt", b"a\xffb".decode(errors="surrogateescape")],
        r"^--prompt: not valid UTF-8 text \(byte 0xff at character 2\)"),
    Bad("generate prompts with a lone surrogate",
        ["generate", "--model", "{model}", "--prompts", "{tmp}/p.jsonl", "--output",
         "{tmp}/out.jsonl"],
        rf"^{{tmp}}/p\.jsonl:1: field 'prompt' {SURROGATE}",
        setup=write("p.jsonl", '{"prompt": "' + LONE + '"}\n')),
    Bad("eval of a cut gzip file", ["eval", "--model", "{model}", "--data",
                                    "{tmp}/chat.jsonl.gz"],
        r"^{tmp}/chat\.jsonl\.gz: cannot read \(Compressed file ended before",
        setup=lambda tmp, assets: (tmp / "chat.jsonl.gz").write_bytes(cut_gzip())),
    Bad("preprocess parquet string that is not UTF-8",
        ["preprocess", "--input", "{tmp}/c.parquet", "--output-prefix", "{tmp}/p",
         "--tokenizer", "{tokenizer}", "--workers", "2"],
        r"^{tmp}/c\.parquet:2: field 'text' is not valid UTF-8 \(byte 0xff at byte 1\)",
        setup=lambda tmp, assets: parquet_not_utf8(tmp / "c.parquet")),
    Bad("tokenizer train on a parquet string that is not UTF-8",
        ["tokenizer", "train", "--input", "{tmp}/c.parquet", "--vocab-size", "300",
         "--output", "{tmp}/tok"],
        r"^{tmp}/c\.parquet:2: field 'text' is not valid UTF-8 \(byte 0xff at byte 1\)",
        setup=lambda tmp, assets: parquet_not_utf8(tmp / "c.parquet")),
]


def cut_gzip() -> bytes:
    """The first half of a gzipped chat file (a copy cut short)."""
    whole = gzip.compress(jsonl(*[{"prompt": f"hi {i}", "response": "a"} for i in range(99)])
                          .encode())
    return whole[:len(whole) // 2]


def parquet_not_utf8(path) -> None:
    """A parquet file whose second 'text' is the bytes ff fe: arrow stores a string
    column's bytes as another writer gave them, unchecked."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    column = pa.array([b"fine", b"\xff\xfe"], pa.binary()).view(pa.string())
    pq.write_table(pa.table({"text": column}), str(path))


TABLE = PREFERENCE + ODD_JSON


@pytest.mark.parametrize("row", params(TABLE))
def test_data_input_is_refused_in_one_line(row, bad_input_assets, tmp_path, capsys,
                                           monkeypatch):
    monkeypatch.delenv("LMFORGE_DEBUG", raising=False)
    check_refused(row, bad_input_assets, tmp_path, capsys)
