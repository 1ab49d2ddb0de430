"""``lmforge preprocess``: formats, workers, errors, atomic output, flat memory."""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from lmforge.data.errors import DataError
from lmforge.data.indexed import IndexedDataset
from lmforge.cli import build_parser, main
from lmforge.data.preprocess import preprocess

from .conftest import make_docs, write_jsonl

SRC = str(Path(__file__).resolve().parents[3] / "src")


def _expected(tokenizer, texts, eod=True):
    return [tokenizer.encode(t) + ([tokenizer.eos_id] if eod else []) for t in texts]


def _documents(prefix):
    ds = IndexedDataset(prefix)
    return [ds.document(i).tolist() for i in range(ds.num_documents)]


def test_jsonl_matches_direct_tokenization(tmp_path, tokenizer, tokenizer_dir, docs):
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": d, "id": i} for i, d in enumerate(docs)])
    stats = preprocess([src], tmp_path / "out" / "p", tokenizer_dir, append_eod=True,
                       chunk_mb=0.01)
    assert _documents(tmp_path / "out" / "p") == _expected(tokenizer, docs)
    assert stats.documents == len(docs) and stats.tokens == sum(map(len, _expected(
        tokenizer, docs)))
    assert IndexedDataset(tmp_path / "out" / "p").dtype == np.uint16
    # the pair, its record, and no lock or temporary file left behind
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["p.bin", "p.idx", "p.pair"]


def test_workers_give_identical_files(tmp_path, tokenizer_dir, docs):
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": d} for d in docs * 3])
    preprocess([src], tmp_path / "one", tokenizer_dir, append_eod=True, workers=1,
               chunk_mb=0.005)
    preprocess([src], tmp_path / "two", tokenizer_dir, append_eod=True, workers=2,
               chunk_mb=0.005)
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"one{ext}").read_bytes() == (tmp_path / f"two{ext}").read_bytes()


def test_directory_of_every_format_is_walked_sorted_skipping_hidden_and_caches(
        tmp_path, tokenizer, tokenizer_dir, docs):
    d = tmp_path / "in"
    (d / "sub").mkdir(parents=True)
    write_jsonl(d / "a.jsonl", [{"text": t} for t in docs[:5]])
    with gzip.open(d / "b.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in docs[5:10])
    (d / "c.json").write_text(json.dumps([{"text": t, "n": [1, {"x": "]"}]}
                                          for t in docs[10:15]], indent=2))
    (d / "sub" / "d.txt").write_text(docs[15] + "\n\n" + docs[16])
    (d / "notes.md").write_text("ignored: not an input type")
    (d / ".hidden").mkdir()
    write_jsonl(d / ".hidden" / "x.jsonl", [{"text": "ignored: hidden"}])
    (d / "old.lmforge-index").mkdir()
    (d / "old.lmforge-index" / "meta.json").write_text('{"ignored": "our own cache"}')
    expected = docs[:15] + [docs[15] + "\n\n" + docs[16]]
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": docs[17:20], "n": [1, 2, 3]}), d / "e.parquet")
        expected += docs[17:20]
    except ImportError:
        pass
    preprocess([d], tmp_path / "p", tokenizer_dir, append_eod=True, chunk_mb=0.001)
    got = _documents(tmp_path / "p")
    # sorted walk: a.jsonl, b.jsonl.gz, c.json, e.parquet, sub/d.txt
    order = expected[:15] + expected[16:] + [expected[15]]
    assert [tokenizer.decode(g) for g in got] == order
    assert got[:15] == _expected(tokenizer, docs[:15])


def test_large_txt_split_into_pieces_stays_one_document(tmp_path, tokenizer, tokenizer_dir):
    text = "\n".join(make_docs(200, seed=5))
    (tmp_path / "big.txt").write_text(text)
    preprocess([tmp_path / "big.txt"], tmp_path / "p", tokenizer_dir, append_eod=True,
               chunk_mb=0.001)  # ~1 KB pieces
    (doc,) = _documents(tmp_path / "p")
    assert doc[-1] == tokenizer.eos_id and tokenizer.decode(doc) == text


def test_several_keys_write_one_dataset_each_with_megatron_names(tmp_path, tokenizer,
                                                                 tokenizer_dir, docs):
    src = write_jsonl(tmp_path / "a.jsonl", [{"q": d, "a": d.upper()} for d in docs[:20]])
    preprocess([src], tmp_path / "p", tokenizer_dir, json_keys=("q", "a"))
    assert _documents(tmp_path / "p_q_document") == _expected(tokenizer, docs[:20], False)
    assert _documents(tmp_path / "p_a_document") == _expected(
        tokenizer, [d.upper() for d in docs[:20]], False)


BAD = {
    "bad_json": (b'{"text": "ok"}\n{"text": "oops\n', r"a\.jsonl:2: not valid JSON"),
    "missing_key": (b'{"text": "ok"}\n\n{"body": "x"}\n',
                    r"a\.jsonl:3: no key 'text' \(keys: body\)"),
    "bad_utf8": (b'{"text": "ok"}\n{"text": "caf\xe9"}\n',
                 r"a\.jsonl:2: not valid UTF-8 \(byte 0xe9"),
    "not_object": (b'["text"]\n', r"a\.jsonl:1: expected a JSON object, got an array"),
    "not_string": (b'{"text": 3}\n', r"a\.jsonl:1: key 'text' is a number, not a string"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_record_stops_with_file_and_line(tmp_path, tokenizer_dir, case):
    content, pattern = BAD[case]
    (tmp_path / "a.jsonl").write_bytes(content)
    with pytest.raises(DataError, match=pattern) as err:
        preprocess([tmp_path / "a.jsonl"], tmp_path / "p", tokenizer_dir)
    assert "\n" not in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl"]  # nothing left behind


def test_skip_mode_counts_and_locates_bad_records(tmp_path, tokenizer_dir, docs):
    lines = [json.dumps({"text": d}).encode() for d in docs[:10]]
    lines[2] = b"{not json"
    lines[5] = b'{"body": 1}'
    lines[7] = b'{"text": "\xff"}'
    (tmp_path / "a.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    stats = preprocess([tmp_path / "a.jsonl"], tmp_path / "p", tokenizer_dir,
                       on_error="skip", chunk_mb=0.001)
    assert stats.skipped == 3 and stats.documents == 7
    summary = stats.summary()
    for line in (3, 6, 8):
        assert f"a.jsonl:{line}: " in summary
    assert "skipped 3 bad record(s)" in summary


def test_empty_documents_are_left_out_and_counted(tmp_path, tokenizer, tokenizer_dir):
    write_jsonl(tmp_path / "a.jsonl", [{"text": "one"}, {"text": ""}, {"text": "  \n"},
                                       {"text": "two"}])
    (tmp_path / "b.txt").write_text("")
    stats = preprocess([tmp_path / "a.jsonl", tmp_path / "b.txt"], tmp_path / "p",
                       tokenizer_dir, append_eod=True)
    assert stats.outputs[0].empty == 3 and stats.documents == 2
    assert _documents(tmp_path / "p") == _expected(tokenizer, ["one", "two"])
    assert "3 empty documents left out" in stats.summary()


@pytest.mark.parametrize("content", ["", '{"text": ""}\n{"text": " \\n"}\n'],
                         ids=["no records", "only empty texts"])
def test_an_input_without_a_document_is_refused_and_nothing_written(tmp_path, tokenizer_dir,
                                                                     content):
    (tmp_path / "a.jsonl").write_text(content)
    with pytest.raises(DataError, match=r"^--input .*a\.jsonl: no documents to write") as e:
        preprocess([tmp_path / "a.jsonl"], tmp_path / "new" / "dir" / "p", tokenizer_dir)
    assert "\n" not in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl"]  # not even the dirs


def test_a_second_job_on_a_prefix_being_written_is_refused_and_the_pair_stays_one(
        tmp_path, tokenizer, tokenizer_dir, monkeypatch):
    """Job B starts while job A renames its files into place (between its .bin and its
    .idx): B is refused naming the prefix and A, and A's pair is what stays."""
    from lmforge import fsio

    write_jsonl(tmp_path / "a.jsonl", [{"text": "first job's text"}])
    write_jsonl(tmp_path / "b.jsonl", [{"text": "the second job writes other words"}])
    rename, refusals = fsio.replace_file, []

    def rename_then_start_b(tmp, path):
        rename(tmp, path)
        if str(path).endswith(".bin") and not refusals:
            try:
                preprocess([tmp_path / "b.jsonl"], tmp_path / "p", tokenizer_dir)
                refusals.append(None)
            except DataError as e:
                refusals.append(str(e))

    monkeypatch.setattr(fsio, "replace_file", rename_then_start_b)
    preprocess([tmp_path / "a.jsonl"], tmp_path / "p", tokenizer_dir)
    assert refusals[0] is not None, "the second job ran"
    assert refusals[0].startswith(f"--output-prefix: {tmp_path / 'p'} is being written by "
                                  f"another preprocess (pid {os.getpid()} on ")
    assert _documents(tmp_path / "p") == _expected(tokenizer, ["first job's text"], False)
    assert not (tmp_path / "p.lock").exists()


def test_bad_inputs_are_refused_naming_file_and_line_leaving_no_output(tmp_path, tokenizer_dir):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "readme.md").write_text("x")
    with pytest.raises(DataError, match="empty: no usable input files"):
        preprocess([tmp_path / "empty"], tmp_path / "p", tokenizer_dir)
    with pytest.raises(DataError, match="nope.jsonl: no such file"):
        preprocess([tmp_path / "nope.jsonl"], tmp_path / "p", tokenizer_dir)
    with pytest.raises(DataError, match="unsupported file type"):
        preprocess([tmp_path / "empty" / "readme.md"], tmp_path / "p", tokenizer_dir)
    (tmp_path / "a.json").write_text('[{"text": "a"},\n {"text": "b"}\n {"text": "c"}]')
    with pytest.raises(DataError, match=r"a\.json:3: not valid JSON \(expected ','"):
        preprocess([tmp_path / "a.json"], tmp_path / "p", tokenizer_dir)
    (tmp_path / "b.txt").write_bytes(b"fine\nalso fine\nbad \xff here\n")
    with pytest.raises(DataError, match=r"b\.txt:3: not valid UTF-8 \(byte 0xff at column 5"):
        preprocess([tmp_path / "b.txt"], tmp_path / "p", tokenizer_dir)
    (tmp_path / "c.jsonl.gz").write_bytes(b"\x1f\x8b\x08garbage")
    with pytest.raises(DataError, match="c.jsonl.gz: cannot read"):
        preprocess([tmp_path / "c.jsonl.gz"], tmp_path / "p", tokenizer_dir)
    assert not list(tmp_path.glob("p*"))


def test_failed_run_keeps_previous_output(tmp_path, tokenizer_dir):
    good = write_jsonl(tmp_path / "good.jsonl", [{"text": "hello world"}])
    preprocess([good], tmp_path / "p", tokenizer_dir)
    before = (tmp_path / "p.bin").read_bytes(), (tmp_path / "p.idx").read_bytes()
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"text": "fine"}, {"nope": 1}])
    with pytest.raises(DataError):
        preprocess([bad], tmp_path / "p", tokenizer_dir)
    assert ((tmp_path / "p.bin").read_bytes(), (tmp_path / "p.idx").read_bytes()) == before
    assert not list(tmp_path.glob("*tmp*"))


def test_cli_preprocesses_and_refuses_a_missing_input_in_one_line(tmp_path, tokenizer_dir,
                                                                   docs, capsys):
    src = write_jsonl(tmp_path / "a.jsonl", [{"body": d} for d in docs[:30]])
    args = build_parser().parse_args(["preprocess", "--input", str(src), "--output-prefix",
                              str(tmp_path / "p"), "--tokenizer", str(tokenizer_dir),
                              "--json-key", "body", "--append-eod"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "30 documents" in out and "tokens/s" in out
    assert main(["preprocess", "--input", str(tmp_path / "missing.jsonl"), "--output-prefix",
                 str(tmp_path / "q"), "--tokenizer", str(tokenizer_dir)]) == 2
    assert capsys.readouterr().err.strip().endswith("missing.jsonl: no such file or directory")


def test_command_with_worker_processes_matches_megatron_and_names_a_bad_line(
        tmp_path, tokenizer, tokenizer_dir, docs, megatron):
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": d} for d in docs])
    env = dict(os.environ, PYTHONPATH=SRC)
    run = subprocess.run(
        [sys.executable, "-m", "lmforge.cli", "preprocess", "--input", str(src),
         "--output-prefix", str(tmp_path / "p"), "--tokenizer", str(tokenizer_dir),
         "--append-eod", "--workers", "2", "--chunk-mb", "0.01"],
        env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert f"{len(docs):,} documents" in run.stdout
    # Megatron-LM's own reader sees the same documents
    theirs = megatron.IndexedDataset(str(tmp_path / "p"))
    assert [theirs[i].tolist() for i in range(len(theirs))] == _expected(tokenizer, docs)
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "x"}\n{"text": \n')
    run = subprocess.run(
        [sys.executable, "-m", "lmforge.cli", "preprocess", "--input", str(bad),
         "--output-prefix", str(tmp_path / "q"), "--tokenizer", str(tokenizer_dir),
         "--workers", "2"], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        f"lmforge: error: {bad}:2: not valid JSON (Expecting value, column 10)"]


_PEAK = textwrap.dedent("""
    import resource, sys
    from lmforge.data.preprocess import preprocess
    preprocess([sys.argv[1]], sys.argv[2], sys.argv[3], append_eod=True, chunk_mb=0.0625)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
""")


def _write_corpus(path: Path, megabytes: float) -> None:
    docs = [json.dumps({"text": d}) + "\n" for d in make_docs(400, seed=9, max_words=200)]
    size = 0
    with open(path, "w") as f:
        while size < megabytes * 1e6:
            for line in docs:
                f.write(line)
                size += len(line)


def test_peak_memory_flat_as_input_grows_10x(tmp_path, tokenizer_dir):
    peaks = []
    for mb in (0.3, 3.0):
        src = tmp_path / f"in{mb}.jsonl"
        _write_corpus(src, mb)
        run = subprocess.run([sys.executable, "-c", _PEAK, str(src), str(tmp_path / f"p{mb}"),
                              str(tokenizer_dir)], env=dict(os.environ, PYTHONPATH=SRC),
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        peaks.append(int(run.stdout.split()[-1]) / 1024)  # MiB
    # Holding the input (or its tokens as Python ints) would add tens of MiB here.
    assert peaks[1] - peaks[0] < 8, f"peak RSS {peaks[0]:.1f} -> {peaks[1]:.1f} MiB"


def test_parquet_errors_name_the_row(tmp_path, tokenizer_dir):
    pa = pytest.importorskip("pyarrow", reason="pyarrow not installed")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a b", None, "c"]}), tmp_path / "a.parquet")
    with pytest.raises(DataError, match=r"a\.parquet:2: key 'text' is null, not a string"):
        preprocess([tmp_path / "a.parquet"], tmp_path / "p", tokenizer_dir)
    stats = preprocess([tmp_path / "a.parquet"], tmp_path / "p", tokenizer_dir,
                       on_error="skip")
    assert stats.documents == 2 and stats.skipped == 1
    with pytest.raises(DataError, match=r"a\.parquet: no column 'body' \(columns: text\)"):
        preprocess([tmp_path / "a.parquet"], tmp_path / "p", tokenizer_dir, json_keys=("body",))


@pytest.mark.parametrize("kind", ["llama2", "llama3", "chatml"])
def test_documents_keep_what_the_tokenizer_adds_as_megatron_does(tmp_path, kind, megatron):
    transformers = pytest.importorskip("transformers")
    from helpers.real_tokenizers import corpus, save_tokenizer

    tok_dir = save_tokenizer(kind, tmp_path / "tok")
    hf = transformers.AutoTokenizer.from_pretrained(tok_dir)
    texts = corpus(30, seed=7)
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in texts])
    long_doc = " ".join(corpus(600, seed=8))  # a .txt document read in several pieces
    (tmp_path / "b.txt").write_text(long_doc)
    eod = [hf.eos_token_id]
    cases = {"tokenizer": lambda t: hf(t)["input_ids"],
             "none": lambda t: hf(t, add_special_tokens=False)["input_ids"]}
    for mode, encode in cases.items():
        prefix = tmp_path / mode
        preprocess([src], prefix, tok_dir, append_eod=True, special_tokens=mode, chunk_mb=0.01)
        expected = [encode(t) + eod for t in texts]
        assert _documents(prefix) == expected, mode
        theirs = megatron.IndexedDataset(str(prefix))
        assert [theirs[i].tolist() for i in range(len(theirs))] == expected
        preprocess([tmp_path / "b.txt"], tmp_path / f"{mode}-txt", tok_dir, append_eod=True,
                   special_tokens=mode, chunk_mb=0.001)
        (doc,) = _documents(tmp_path / f"{mode}-txt")
        whole = encode(long_doc) + eod
        added = set(hf.all_special_ids)
        # the special tokens go around the whole document once, not around each piece
        assert [i for i in doc if i in added] == [i for i in whole if i in added], mode
        assert doc[:2] == whole[:2] and doc[-2:] == whole[-2:]
    if kind != "chatml":  # Llama-2/3 tokenizers add a BOS; a ChatML one adds nothing
        assert _documents(tmp_path / "tokenizer")[0][0] == hf.bos_token_id
        assert _documents(tmp_path / "none")[0][0] != hf.bos_token_id
    else:
        assert _documents(tmp_path / "tokenizer") == _documents(tmp_path / "none")
    with pytest.raises(DataError, match="--special-tokens: 'all' is not one of"):
        preprocess([src], tmp_path / "x", tok_dir, special_tokens="all")
