"""Bad inputs of ``lmforge generate`` (the harness: tests/helpers/bad_inputs.py): the
prompt file, its records, the batch size, prompts and limits the model's context cannot
hold, and sampling values that are not finite. Each is refused in one line naming the
option or the file:line, before anything is written."""
from __future__ import annotations

import pytest

from helpers.bad_inputs import Bad, check_refused, fifo, params, write

RUN = ["generate", "--model", "{model}", "--prompts", "{tmp}/p.jsonl",
       "--output", "{tmp}/out.jsonl"]
ONE = ["generate", "--model", "{model}", "--prompt", "hi"]
GOOD = '{"prompt": "line 1 of a small corpus"}\n'
LONG = "line 7 of a small corpus about tensors and shards " * 10  # > 64 tokens


def prompts(text: str):
    return write("p.jsonl", text)


TABLE = [
    Bad("empty prompt file", RUN, r"^\S*p\.jsonl: --prompts holds no record",
        setup=prompts("")),
    Bad("prompt file of blank lines", RUN, r"^\S*p\.jsonl: --prompts holds no record",
        setup=prompts("\n  \n\n")),
    Bad("record without a prompt", RUN, r"^\S*p\.jsonl:2: a record needs a 'prompt'",
        setup=prompts(GOOD + '{"text": "no prompt"}\n')),
    Bad("record that is not an object", RUN, r"^\S*p\.jsonl:1: a record needs a 'prompt'",
        setup=prompts('["line 1"]\n')),
    Bad("prompt that is not text", RUN, r"^\S*p\.jsonl:2: 'prompt' must be text",
        setup=prompts(GOOD + '{"prompt": 3}\n')),
    Bad("record that is not JSON", RUN, r"^\S*p\.jsonl:2: not valid JSON",
        setup=prompts(GOOD + '{"prompt": \n')),
    Bad("missing prompt file", RUN, r"^\S*p\.jsonl: --prompts: no such file"),
    Bad("prompt file that is a FIFO", RUN, r"^\S*p\.jsonl: --prompts is not a regular file",
        setup=fifo("p.jsonl")),
    Bad("zero batch size", RUN + ["--batch-size", "0"], r"^--batch-size: 0 must be >= 1",
        setup=prompts(GOOD)),
    Bad("negative batch size", RUN + ["--batch-size", "-2"], r"^--batch-size: -2 must be >= 1",
        setup=prompts(GOOD)),
    Bad("prompt longer than the context", RUN,
        r"^\S*p\.jsonl:2: the prompt has \d+ tokens; the model's context holds 64",
        setup=prompts(GOOD + '{"prompt": "%s"}\n' % LONG)),
    Bad("--prompt longer than the context", ["generate", "--model", "{model}", "--prompt", LONG],
        r"^--prompt: the prompt has \d+ tokens; the model's context holds 64"),
    Bad("new tokens past the context", RUN + ["--max-new-tokens", "60"],
        r"^--max-new-tokens: 60 after the \d+-token prompt of \S*p\.jsonl:1 passes the "
        r"model's context of 64; lower it to \d+", setup=prompts(GOOD)),
    Bad("new tokens past the context after --prompt", ONE + ["--max-new-tokens", "64"],
        r"^--max-new-tokens: 64 after the \d+-token prompt of --prompt passes the model's "
        r"context of 64; lower it to \d+"),
    Bad("infinite temperature", RUN + ["--temperature", "inf"],
        r"^--temperature: inf must be a finite number", setup=prompts(GOOD)),
    Bad("nan top-p", RUN + ["--top-p", "nan"], r"^--top-p: nan must be in \(0, 1\]",
        setup=prompts(GOOD)),
    Bad("nan min-p", RUN + ["--min-p", "nan"], r"^--min-p: nan must be in \[0, 1\]",
        setup=prompts(GOOD)),
    Bad("min-p above one", ONE + ["--min-p", "1.5"], r"^--min-p: 1\.5 must be in \[0, 1\]"),
    Bad("prompts without an output", RUN[:-2], r"^--prompts: needs --output",
        setup=prompts(GOOD)),
    Bad("output without prompts", ONE + ["--output", "{tmp}/out.jsonl"],
        r"^--output: goes with --prompts"),
    Bad("output over the prompt file", RUN[:-1] + ["{tmp}/p.jsonl"],
        r"--output is the input --prompts", setup=prompts(GOOD)),
    Bad("output that is a FIFO", RUN, r"out\.jsonl: --output is a file to write, but a FIFO",
        setup=lambda tmp, assets: (prompts(GOOD)(tmp, assets), fifo("out.jsonl")(tmp, assets))),
]


@pytest.mark.parametrize("row", params(TABLE))
def test_generate_input_is_refused_in_one_line(row, bad_input_assets, tmp_path, capsys,
                                               monkeypatch):
    monkeypatch.delenv("LMFORGE_DEBUG", raising=False)
    check_refused(row, bad_input_assets, tmp_path, capsys)


def test_prompts_file_gives_each_record_in_order_what_one_prompt_gives(bad_input_assets,
                                                                         tmp_path, capsys):
    """--prompts in batches of 2: every record keeps its fields and gains its completion,
    ids and finish reason, in the input's order, equal to the same prompt given alone."""
    import json

    from lmforge.cli import main

    texts = ["line 3 of a small", "line", "line 12 of a small corpus about", "tensors"]
    records = [{"prompt": t, "id": i} for i, t in enumerate(texts)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    model = str(bad_input_assets["model"])
    assert main(["generate", "--model", model, "--prompts", str(tmp_path / "p.jsonl"),
                 "--output", str(tmp_path / "out.jsonl"), "--batch-size", "2", "--greedy",
                 "--max-new-tokens", "6", "--device", "cpu"]) == 0
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [(o["id"], o["prompt"]) for o in out] == [(r["id"], r["prompt"]) for r in records]
    assert all(o["finish_reason"] in ("stop", "length") for o in out)
    assert all(len(o["completion_ids"]) == 6 for o in out if o["finish_reason"] == "length")
    capsys.readouterr()
    assert main(["generate", "--model", model, "--prompt", texts[2], "--greedy",
                 "--max-new-tokens", "6", "--device", "cpu"]) == 0
    assert capsys.readouterr().out == texts[2] + out[2]["completion"] + "\n"
