"""Bad inputs of ``lmforge generate`` (the harness: tests/helpers/bad_inputs.py): the
prompt file, its records (chat messages as GRPO checks them, fields the output would
overwrite), the batch size, prompts and limits the model's context cannot hold, sampling
values that cannot sample (not finite, a temperature under the floor, a seed out of range,
--greedy with a sampling option), an output that cannot be written, and a model whose
tokenizer or stop ids pass its vocabulary or whose weights are not floating point. Each is
refused in one line naming the option, the file or the file:line, before anything is
written."""
from __future__ import annotations

import pytest

from helpers.bad_inputs import (GEN, Bad, check_refused, edit_json, edit_tensors, fifo,
                                model_with, params, write)

RUN = ["generate", "--model", "{model}", "--prompts", "{tmp}/p.jsonl",
       "--output", "{tmp}/out.jsonl"]
ONE = ["generate", "--model", "{model}", "--prompt", "hi"]
GOOD = '{"prompt": "line 1 of a small corpus"}\n'
LONG = "line 7 of a small corpus about tensors and shards " * 10  # > 64 tokens


def prompts(text: str):
    return write("p.jsonl", text)


def chat(*messages) -> str:
    import json
    return json.dumps({"prompt": [{"role": r, "content": c} for r, c in messages]}) + "\n"


# A chat template that renders any roles in any order (the checks are lmforge's own).
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}\n"
            "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
CHAT_RUN = ["generate", "--model", "{tmp}/model", "--prompts", "{tmp}/p.jsonl",
            "--output", "{tmp}/out.jsonl", "--chat"]


def chat_prompts(text: str):
    """A setup: the row's model copy with TEMPLATE, and p.jsonl holding ``text``."""
    return model_with(edit_json("model/tokenizer_config.json", chat_template=TEMPLATE),
                      prompts(text))


def vocab_cut_to(rows: int):
    """A setup: the row's model copy with only the first ``rows`` embeddings and head rows
    (config.json says so), its 300-token tokenizer kept."""
    def cut(tensors: dict) -> None:
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            tensors[name] = tensors[name][:rows].contiguous()
    return model_with(edit_tensors("model/model.safetensors", cut),
                      edit_json("model/config.json", vocab_size=rows))


def embedding_as_int32(tensors: dict) -> None:
    import torch
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].to(torch.int32)


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
    # issue 44.4: an output that cannot be written is refused before the decode
    Bad("output in a missing directory", RUN[:-1] + ["{tmp}/missing/out.jsonl"],
        r"^\S*missing/out\.jsonl: --output: the directory \S*missing does not exist",
        setup=prompts(GOOD)),
    Bad("output ending in a slash", RUN[:-1] + ["{tmp}/out/"],
        r"^\S*out/: --output ends in '/': name the file to write",
        setup=prompts(GOOD)),
    # the model's tokenizer and stop ids against its vocabulary, its weights' dtype
    Bad("tokenizer larger than the vocabulary", GEN,
        r"tokenizer has 300 tokens, the weights' vocabulary 200 \(config\.json "
        r"vocab_size\)", setup=vocab_cut_to(200)),
    Bad("eos_token_id past the vocabulary", GEN,
        r"generation_config\.json: eos_token_id: 5000 is past the model's vocabulary of 300",
        setup=model_with(edit_json("model/generation_config.json", eos_token_id=5000))),
    Bad("integer embedding", GEN,
        r"model\.safetensors: tensor model\.embed_tokens\.weight is torch\.int32; a "
        r"model's weights are floating point",
        setup=model_with(edit_tensors("model/model.safetensors", embedding_as_int32))),
    # sampling settings that cannot sample, or contradict each other
    Bad("temperature under the floor", ONE + ["--temperature", "1e-45"],
        r"^--temperature: 1e-45 must be 0 \(greedy\) or >= 0\.01"),
    Bad("negative seed", ONE + ["--seed", "-1"],
        r"^--seed: -1 must be in \[0, 2\*\*63 - 1\]"),
    Bad("seed past 64 bits", ONE + ["--seed", str(2**64)],
        r"^--seed: 18446744073709551616 must be in \[0, 2\*\*63 - 1\]"),
    Bad("greedy with a temperature", ONE + ["--greedy", "--temperature", "0.5"],
        r"^--greedy contradicts --temperature 0\.5 \(greedy decoding takes the likeliest "
        r"token; drop one\)"),
    Bad("greedy with a top-p", ONE + ["--greedy", "--top-p", "0.9"],
        r"^--greedy contradicts --top-p 0\.9"),
    # --chat: message lists checked as GRPO's prompts are (data/prompts.py)
    Bad("chat message with an unknown role", CHAT_RUN,
        r"^\S*p\.jsonl:1: 'prompt' message 1 has role 'bot'",
        setup=chat_prompts(chat(("bot", "hi")))),
    Bad("chat ending with the assistant", CHAT_RUN,
        r"^\S*p\.jsonl:2: 'prompt' must end with a user message",
        setup=chat_prompts(GOOD + chat(("user", "hi"), ("assistant", "hello")))),
    Bad("chat of a system message alone", CHAT_RUN,
        r"^\S*p\.jsonl:1: 'prompt' must end with a user message",
        setup=chat_prompts(chat(("system", "be brief")))),
    Bad("chat of two user turns in a row", CHAT_RUN,
        r"^\S*p\.jsonl:1: 'prompt' message 2 is 'user', expected 'assistant'",
        setup=chat_prompts(chat(("user", "hi"), ("user", "again")))),
    Bad("chat with an empty message list", CHAT_RUN,
        r"^\S*p\.jsonl:1: 'prompt' must be a string or a list of messages",
        setup=chat_prompts('{"prompt": []}\n')),
    # a field the output adds is already in the record (the docs: refused, never replaced)
    Bad("record with a completion", RUN,
        r"^\S*p\.jsonl:2: the record already has 'completion'",
        setup=prompts(GOOD + '{"prompt": "line 2", "completion": "mine"}\n')),
    Bad("record with completion ids and a finish reason", RUN,
        r"^\S*p\.jsonl:1: the record already has 'completion_ids', 'finish_reason'",
        setup=prompts('{"prompt": "x", "finish_reason": "stop", "completion_ids": []}\n')),
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
