"""Chat templates from the model (Jinja in tokenizer_config.json or chat_template.jinja):
token ids equal transformers' ``apply_chat_template``, and exactly the assistant replies
plus their end-of-turn token are trained."""
from __future__ import annotations

import re

import numpy as np
import pytest

from lmforge.data.errors import DataError
from lmforge.data.sft import SFTDataset, record_messages
from lmforge.data.templates import CHATML, ChatTemplate, JinjaTemplate, get_template
from lmforge.data.tokenizer import load_tokenizer

from helpers.real_tokenizers import KINDS, save_tokenizer

from .conftest import trained_runs, write_jsonl

transformers = pytest.importorskip("transformers")

SINGLE = [{"role": "user", "content": "say hi"}, {"role": "assistant", "content": "hello there"}]
MULTI = [{"role": "user", "content": "what is up"},
         {"role": "assistant", "content": "the sky"},
         {"role": "user", "content": "and down"},
         {"role": "assistant", "content": "the ground below"}]
WITH_SYSTEM = [{"role": "system", "content": "be brief"}] + MULTI
EOT = {"llama2": "</s>", "llama3": "<|eot_id|>", "chatml": "<|im_end|>"}


@pytest.fixture(scope="module", params=KINDS)
def model_tokenizer(request, tmp_path_factory):
    """(kind, our tokenizer, transformers' tokenizer) of one directory."""
    out = save_tokenizer(request.param, tmp_path_factory.mktemp(request.param))
    return (request.param, load_tokenizer(out),
            transformers.AutoTokenizer.from_pretrained(out))


def _hf_ids(hf, messages, **kw) -> list[int]:
    out = hf.apply_chat_template(messages, tokenize=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _squeeze(text: str) -> str:
    return "".join(text.split())


@pytest.mark.parametrize("messages", [SINGLE, MULTI, WITH_SYSTEM],
                         ids=["single", "multi", "system"])
def test_model_template_ids_equal_apply_chat_template(model_tokenizer, messages):
    kind, tok, hf = model_tokenizer
    template = get_template("auto", tok)
    assert isinstance(template, JinjaTemplate)
    ids, trained = template.encode(record_messages({"messages": messages}, "x:1"), tok)
    assert ids.tolist() == _hf_ids(hf, messages)
    # the trained tokens are each reply and its end-of-turn token, and nothing else
    replies = [m["content"] for m in messages if m["role"] == "assistant"]
    runs = trained_runs(tok, ids, trained)
    assert [_squeeze(r) for r in runs] == [_squeeze(a + EOT[kind]) for a in replies]
    assert all(r.rstrip().endswith(EOT[kind]) for r in runs)
    untrained = tok.decode(ids[~trained].tolist(), skip_special=False)
    for m in messages:
        if m["role"] != "assistant":
            assert m["content"] in untrained


def test_template_in_chat_template_jinja_is_read_as_transformers_reads_it(tmp_path):
    out = save_tokenizer("chatml", tmp_path, jinja_file=True)
    assert "chat_template" not in (out / "tokenizer_config.json").read_text()
    tok, hf = load_tokenizer(out), transformers.AutoTokenizer.from_pretrained(out)
    ids, _ = get_template("auto", tok).encode(WITH_SYSTEM, tok)
    assert ids.tolist() == _hf_ids(hf, WITH_SYSTEM)
    tok.save(tmp_path / "saved")  # an export keeps it (in tokenizer_config.json)
    assert load_tokenizer(tmp_path / "saved").chat_template == tok.chat_template


def test_generation_prompt_and_end_of_turn_follow_the_template(model_tokenizer):
    kind, tok, hf = model_tokenizer
    template = get_template("auto", tok)
    assert template.prompt_ids(MULTI[:3], tok) == _hf_ids(hf, MULTI[:3],
                                                          add_generation_prompt=True)
    assert template.end_of_turn(tok) == EOT[kind]
    assert template.end_of_turn_id(tok) == hf.convert_tokens_to_ids(EOT[kind])


def test_builtin_chatml_renders_as_a_chatml_model_template(tmp_path):
    """``data.template=chatml`` on a ChatML tokenizer without a template of its own."""
    plain = load_tokenizer(save_tokenizer("chatml", tmp_path / "bare", template=None))
    assert plain.chat_template is None
    assert isinstance(get_template("auto", plain), ChatTemplate)  # auto falls back to plain
    with_template = save_tokenizer("chatml", tmp_path / "t", template=CHATML)
    hf = transformers.AutoTokenizer.from_pretrained(with_template)
    ids, trained = get_template("chatml", plain).encode(WITH_SYSTEM, plain)
    assert ids.tolist() == _hf_ids(hf, WITH_SYSTEM)
    assert trained_runs(plain, ids, trained) == ["the sky<|im_end|>",
                                                  "the ground below<|im_end|>"]


def test_chatml_needs_its_tokens(tmp_path):
    llama3 = load_tokenizer(save_tokenizer("llama3", tmp_path))
    with pytest.raises(DataError, match=re.escape("chatml needs the token '<|im_start|>'")):
        get_template("chatml", llama3)


def test_sft_dataset_uses_the_model_template_and_keys_its_cache_on_it(tmp_path):
    tok_dir = save_tokenizer("chatml", tmp_path / "tok")
    tok = load_tokenizer(tok_dir)
    hf = transformers.AutoTokenizer.from_pretrained(tok_dir)
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": WITH_SYSTEM}, {
        "prompt": "say hi", "response": "hello there"}] * 3)
    ds = SFTDataset(path, tok, "auto", 64)
    assert ds.sample(0)[0].tolist() == _hf_ids(hf, WITH_SYSTEM)
    assert ds.end_of_turn_id == hf.convert_tokens_to_ids("<|im_end|>")
    other = tok.with_chat_template(tok.chat_template.replace("\\n", "\\n\\n"))
    again = SFTDataset(path, other, "auto", 64)
    assert again.cache != ds.cache  # another template text, another cache
    assert len(again.sample(0)[0]) > len(ds.sample(0)[0])


def test_a_template_that_raises_or_cannot_train_is_refused_with_file_and_line(tmp_path):
    tok = load_tokenizer(save_tokenizer("llama2", tmp_path / "tok"))
    path = write_jsonl(tmp_path / "bad.jsonl", [
        {"messages": SINGLE}, {"messages": [{"role": "system", "content": "x"}] + SINGLE}])
    strict = tok.with_chat_template(
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}"
        "{% endif %}{% for m in messages %}{{ m['content'] + eos_token }}{% endfor %}")
    with pytest.raises(DataError, match=re.escape(f"{path}:2: the chat template cannot render "
                                                  "this conversation (no system role)")):
        SFTDataset(path, strict, "auto", 64)
    # a template that can never train is refused as a setting, before any data is read
    no_end = tok.with_chat_template("{% for m in messages %}{{ m['content'] + '\\n' }}"
                                    "{% endfor %}")
    with pytest.raises(DataError, match=re.escape("data.template: the chat template writes no "
                                                  "special token after assistant message 2")):
        SFTDataset(path, no_end, "auto", 64)
    rewrites = tok.with_chat_template("{% for m in messages %}{{ m['content'] | upper }}"
                                      "{{ eos_token }}{% endfor %}")
    with pytest.raises(DataError, match="data.template: the chat template does not write "
                                        "assistant message 2's content"):
        SFTDataset(path, rewrites, "auto", 64)
    # ... and one that fails on a given record names its line
    odd = tok.with_chat_template(
        "{% for m in messages %}{% if m['content'] == 'x' %}{{ raise_exception('odd') }}"
        "{% endif %}{{ m['content'] + eos_token }}{% endfor %}")
    with pytest.raises(DataError, match=re.escape(f"{path}:2: the chat template cannot render "
                                                  "this conversation (odd)")):
        SFTDataset(path, odd, "auto", 64)
    with pytest.raises(DataError, match="data.template: the chat template does not parse"):
        get_template("auto", tok.with_chat_template("{% for m in messages %}"))


def test_template_code_runs_sandboxed(tmp_path):
    tok = load_tokenizer(save_tokenizer("chatml", tmp_path))
    escape = tok.with_chat_template("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(DataError, match="cannot render"):
        get_template("auto", escape).render(SINGLE, tok)
    mutate = tok.with_chat_template("{{ messages.append(1) }}")
    with pytest.raises(DataError, match="cannot render"):
        get_template("auto", mutate).render(SINGLE, tok)


def test_plain_template_starts_with_what_the_tokenizer_adds(model_tokenizer):
    kind, tok, hf = model_tokenizer
    ids, trained = ChatTemplate("plain").encode(SINGLE, tok)
    prefix = hf("x")["input_ids"][:len(tok.affixes[0])]
    assert ids[:len(prefix)].tolist() == prefix
    assert (len(prefix) == 1) == (kind != "chatml")  # a ChatML tokenizer adds no BOS
    assert not trained[:len(prefix) + 1].any()
    assert np.flatnonzero(trained).size > 0


def test_packed_rows_of_model_template_samples_keep_each_sample_and_its_labels(tmp_path):
    tok = load_tokenizer(save_tokenizer("chatml", tmp_path / "tok"))
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": MULTI}, {"messages": SINGLE},
                                                  {"messages": WITH_SYSTEM}] * 4)
    packed = SFTDataset(path, tok, "auto", 128, pack=True)
    alone = SFTDataset(path, tok, "auto", 128)
    assert packed.cache == alone.cache  # one tokenization serves both
    for k in range(packed.rows_in_epoch(0)):
        row, members = packed[k], packed.samples_of(k)
        assert len(members) > 1  # these samples are short: rows hold several
        start = 0
        for i in members:
            ids, trained = packed.sample(i)
            n = len(ids) - 1
            np.testing.assert_array_equal(row["input_ids"][start:start + n], ids[:-1])
            expected = np.where(trained[1:], ids[1:], -100)
            np.testing.assert_array_equal(row["labels"][start:start + n], expected)
            assert row["positions"][start] == 0 and len(set(row["segments"][start:start + n])) == 1
            start += n
