"""The end-of-run sample's prompt: train.sample_prompt when set; else, for a fine-tuning
run, the first held-out SFT prompt as the chat template renders it for generation, or the
start of the held-out text; no held-out data: no sample, with the reason."""
import json

import pytest

from lmforge.config import load_config
from lmforge.data.build import build_data
from lmforge.data.dataset import held_out_documents
from lmforge.data.templates import get_template
from lmforge.data.tokenizer import load_tokenizer, train_bpe
from lmforge.train.sample import PREFIX_TOKENS, SamplePrompt, choose_sample_prompt

from helpers.real_tokenizers import save_tokenizer

FIRST = {"messages": [{"role": "system", "content": "be brief"},
                      {"role": "user", "content": "what is up"},
                      {"role": "assistant", "content": "the sky"},
                      {"role": "user", "content": "and down"},
                      {"role": "assistant", "content": "the ground"}]}


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    return load_tokenizer(save_tokenizer("chatml", tmp_path_factory.mktemp("chatml")))


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _choose(tokenizer, tmp_path, overrides):
    cfg = load_config(None, ["model.init_from=/models/base", *overrides])
    return choose_sample_prompt(cfg, tokenizer, build_data(cfg, tokenizer,
                                                           cache_dir=tmp_path / "cache"))


def test_sft_takes_the_first_held_out_prompt_rendered_for_generation(chatml, tmp_path):
    train = _jsonl(tmp_path / "train.jsonl", [{"prompt": "say hi", "response": "hi"}])
    held_out = _jsonl(tmp_path / "val.jsonl", [FIRST, {"prompt": "tell me", "response": "no"}])
    prompt = _choose(chatml, tmp_path, ["data.kind=sft", f"data.path={train}",
                                        f"data.eval_path={held_out}"])
    assert isinstance(prompt, SamplePrompt)
    assert prompt.text == ("<|im_start|>system\nbe brief<|im_end|>\n"
                           "<|im_start|>user\nwhat is up<|im_end|>\n<|im_start|>assistant\n")
    template = get_template("auto", chatml)
    assert prompt.ids == template.prompt_ids(FIRST["messages"][:2], chatml)
    assert prompt.stop_ids == (chatml.token_to_id("<|im_end|>"),)


def test_sft_without_held_out_samples_has_no_sample_and_says_why(chatml, tmp_path):
    train = _jsonl(tmp_path / "train.jsonl", [{"prompt": "say hi", "response": "hi"}])
    reason = _choose(chatml, tmp_path, ["data.kind=sft", f"data.path={train}"])
    assert isinstance(reason, str) and "data.eval_path" in reason and "\n" not in reason


def test_sft_without_eval_path_takes_the_first_sample_eval_fraction_holds_out(chatml,
                                                                             tmp_path):
    records = [{"prompt": f"question {i}", "response": f"answer {i}"} for i in range(40)]
    train = _jsonl(tmp_path / "train.jsonl", records)
    prompt = _choose(chatml, tmp_path, ["data.kind=sft", f"data.path={train}",
                                        "data.micro_batch_size=2"])
    first = int(held_out_documents(40, 0.05)[0])  # the default data.eval_fraction
    assert prompt.text == f"<|im_start|>user\nquestion {first}<|im_end|>\n" \
        "<|im_start|>assistant\n"
    assert prompt.source == f"the first held-out sample of {train}"


def test_text_takes_the_start_of_the_held_out_document(tmp_path):
    docs = [f"document {i} " + "alpha beta gamma delta " * 20 for i in range(6)]
    tok = train_bpe(docs, vocab_size=300)
    (tmp_path / "train.txt").write_text("\n".join(docs[:5]))
    (tmp_path / "val.txt").write_text("held out words come first " + docs[5])
    prompt = _choose(tok, tmp_path, ["data.kind=text", f"data.path={tmp_path / 'train.txt'}",
                                     f"data.eval_path={tmp_path / 'val.txt'}",
                                     "data.seq_len=32", "data.micro_batch_size=2"])
    assert len(prompt.ids) == PREFIX_TOKENS
    assert "held out words come first".startswith(prompt.text) and prompt.text
    assert prompt.source == "the held-out data"


def test_text_without_held_out_data_has_no_sample(tmp_path):
    docs = ["alpha beta gamma delta " * 20] * 3
    (tmp_path / "train.txt").write_text("\n".join(docs))
    reason = _choose(train_bpe(docs, vocab_size=270), tmp_path, [
        "data.kind=text", f"data.path={tmp_path / 'train.txt'}", "data.eval_fraction=0",
        "data.seq_len=16", "data.micro_batch_size=2"])
    assert isinstance(reason, str) and "train.sample_prompt" in reason


def test_a_given_prompt_wins_and_the_demo_keeps_def(chatml, tmp_path):
    train = _jsonl(tmp_path / "train.jsonl", [{"prompt": "say hi", "response": "hi"}])
    given = _choose(chatml, tmp_path, ["data.kind=sft", f"data.path={train}",
                                       "train.sample_prompt=Hello"])
    assert given.text == "Hello" and given.ids == chatml.encode("Hello")
    demo = load_config(None)
    assert choose_sample_prompt(demo, chatml, None).text == "def "
