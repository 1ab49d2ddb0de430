"""``lmforge tokenizer train`` on JSON Lines: it learns the records' text, not their syntax."""
import json

from lmforge.cli import main
from lmforge.data.tokenizer import load_tokenizer

WORDS = ("the quick brown fox jumps over a lazy dog while cats sleep in warm sun and "
         "birds sing songs of spring").split()
DOCS = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(12 + i % 5)) + "\n"
        for i in range(40)]


def _train(tmp_path, name: str, *inputs_and_flags: str) -> dict:
    out = tmp_path / name
    assert main(["tokenizer", "train", "--vocab-size", "320", "--output", str(out),
                 "--input", *inputs_and_flags]) == 0
    return json.loads((out / "tokenizer.json").read_text())["model"]


def test_tokenizer_train_learns_the_text_of_jsonl_records_as_if_it_were_plain_text(
        tmp_path, capsys):
    plain = tmp_path / "plain"
    plain.mkdir()
    for i, doc in enumerate(DOCS):  # read in sorted order: the records' order
        (plain / f"{i:03d}.txt").write_text(doc)
    (tmp_path / "corpus.jsonl").write_text(
        "".join(json.dumps({"id": i, "text": doc}) + "\n" for i, doc in enumerate(DOCS)))
    (tmp_path / "other-key.jsonl").write_text(
        "".join(json.dumps({"content": doc, "text": "x"}) + "\n" for doc in DOCS))
    from_text = _train(tmp_path, "from-text", str(plain))
    from_jsonl = _train(tmp_path, "from-jsonl", str(tmp_path / "corpus.jsonl"))
    from_key = _train(tmp_path, "from-key", str(tmp_path / "other-key.jsonl"),
                      "--json-key", "content")
    # learned tokens (the 256 single bytes are there from the start)
    syntax = [t for t in from_jsonl["vocab"] if len(t) > 1 and any(c in t for c in '{}":')]
    assert syntax == [], f"JSON syntax learned as tokens: {syntax}"
    assert from_jsonl == from_text and from_key == from_text  # same vocab, same merges
    sample = "a lazy fox sleeps in the spring sun"
    assert (load_tokenizer(tmp_path / "from-jsonl").encode(sample)
            == load_tokenizer(tmp_path / "from-text").encode(sample))


def test_tokenizer_train_stops_at_a_bad_record_naming_its_file_and_line(tmp_path, capsys):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"body": "no"}) + "\n")
    code = main(["tokenizer", "train", "--input", str(corpus), "--vocab-size", "300",
                 "--output", str(tmp_path / "tok")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err
    assert err.startswith(f"lmforge: error: {corpus}:2: no key 'text'")


def test_tokenizer_train_on_inputs_without_text_is_refused_and_writes_nothing(
        tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.jsonl").write_text('{"text": ""}\n{"text": "  \\n"}\n')
    for name in ("empty.txt", "blank.jsonl"):
        code = main(["tokenizer", "train", "--input", str(tmp_path / name),
                     "--vocab-size", "300", "--output", str(tmp_path / "tok")])
        err = capsys.readouterr().err.strip()
        assert code == 2 and "\n" not in err
        assert err.startswith(f"lmforge: error: --input {tmp_path / name}: no text to "
                              "train a tokenizer on")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blank.jsonl", "empty.txt"]
