"""Models as they come from outside: three tokenizer conventions (Llama-2's ``<s>``,
Llama-3's ``<|begin_of_text|>``, ChatML's nothing) with tiny transformers models. lmforge's
CLI must generate and score exactly as transformers does, and a chat fine-tune must stop
where the model's template ends a reply."""
from __future__ import annotations

import json

import pytest
import torch

from lmforge.cli import main
from lmforge.data.tokenizer import load_tokenizer

from helpers.real_tokenizers import KINDS, save_model
from helpers.hf_models import load_reference
from helpers.runs import run_lmforge

transformers = pytest.importorskip("transformers")

PROMPT = "the sky is blue and"
TEXT = "hello there, tell me about the sea. the ground below is green while rivers run"


@pytest.fixture(scope="module", params=KINDS)
def model_dir(request, tmp_path_factory):
    return save_model(request.param, tmp_path_factory.mktemp(request.param))


def _hf(model_dir):
    return load_reference(model_dir), transformers.AutoTokenizer.from_pretrained(model_dir)


def test_prompt_tokens_follow_the_tokenizer_own_rules(model_dir):
    _, hf_tok = _hf(model_dir)
    ours = load_tokenizer(model_dir)
    assert ours.encode(PROMPT) == hf_tok(PROMPT)["input_ids"]
    adds_bos = model_dir.name.startswith(("llama2", "llama3"))
    assert (ours.encode(PROMPT)[0] == hf_tok.bos_token_id) == adds_bos


def test_generate_greedy_prints_transformers_greedy_continuation(model_dir, capsys):
    model, hf_tok = _hf(model_dir)
    ids = hf_tok(PROMPT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=16, do_sample=False)
    expected = PROMPT + hf_tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert main(["generate", "--model", str(model_dir), "--prompt", PROMPT, "--greedy",
                 "--max-new-tokens", "16", "--device", "cpu"]) == 0
    assert capsys.readouterr().out == expected + "\n"


def test_eval_equals_transformers_mean_token_loss(model_dir, tmp_path, capsys):
    model, hf_tok = _hf(model_dir)
    ids = hf_tok(TEXT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        reference = model(ids, labels=ids).loss.item()
    (tmp_path / "t.txt").write_text(TEXT)
    out = tmp_path / "eval.json"
    assert main(["eval", "--model", str(model_dir), "--data", str(tmp_path / "t.txt"),
                 "--seq-len", "64", "--output", str(out), "--device", "cpu"]) == 0
    result = json.loads(out.read_text())
    assert result["tokens"] == ids.shape[1] - 1
    assert abs(result["loss"] - reference) < 1e-5


def test_chat_fine_tune_exports_and_stops_on_the_template_end_of_turn(tmp_path, capsys):
    """A ChatML model (bos <|im_start|>, eos <|endoftext|>): SFT with its own template, then
    transformers stops the fine-tuned model on <|im_end|>, and so does ``generate --chat``."""
    base = save_model("chatml", tmp_path / "base")
    chat = [{"role": "user", "content": "say hi"},
            {"role": "assistant", "content": "hello there"}]
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": chat}) + "\n")
    run_lmforge(tmp_path / "run", [
        f"model.init_from={base}", "data.kind=sft", f"data.path={tmp_path / 'chat.jsonl'}",
        "data.seq_len=24", "data.micro_batch_size=4", "train.max_steps=30", "optim.lr=1e-2",
        "optim.warmup_steps=0", "train.log_every=10", "train.sample_tokens=1",
        "data.eval_fraction=0"])
    hf_dir = tmp_path / "run" / "hf"
    _, hf_tok = _hf(base)
    im_end = hf_tok.convert_tokens_to_ids("<|im_end|>")
    generation = json.loads((hf_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [hf_tok.eos_token_id, im_end]
    assert load_tokenizer(hf_dir).chat_template == load_tokenizer(base).chat_template

    model, tok = _hf(hf_dir)
    prompt = tok.apply_chat_template(chat[:1], add_generation_prompt=True, return_tensors="pt")
    prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=20, do_sample=False)
    new = out[0, prompt.shape[1]:].tolist()
    assert new[-1] == im_end and len(new) < 20, tok.decode(new)
    assert tok.decode(new, skip_special_tokens=True) == "hello there"

    capsys.readouterr()
    assert main(["generate", "--model", str(hf_dir), "--prompt", "say hi", "--chat",
                 "--greedy", "--max-new-tokens", "20", "--device", "cpu"]) == 0
    assert capsys.readouterr().out == "hello there\n"


def test_eval_json_key_reads_that_field(model_dir, tmp_path):
    """``--json-key body`` scores the ``body`` documents exactly as ``text`` ones."""
    docs = [TEXT, PROMPT + " the ground below is green"]
    results = {}
    for key in ("text", "body"):
        data = tmp_path / f"{key}.jsonl"
        data.write_text("".join(json.dumps({key: d, "id": i}) + "\n" for i, d in enumerate(docs)))
        out = tmp_path / f"{key}.json"
        args = ["eval", "--model", str(model_dir), "--data", str(data), "--seq-len", "64",
                "--output", str(out), "--device", "cpu"]
        assert main(args + (["--json-key", key] if key != "text" else [])) == 0
        results[key] = json.loads(out.read_text())
    assert results["body"]["tokens"] == results["text"]["tokens"] > 0
    assert results["body"]["loss"] == results["text"]["loss"]
    assert main(["eval", "--model", str(model_dir), "--data", str(tmp_path / "body.jsonl"),
                 "--output", str(tmp_path / "x.json"), "--device", "cpu"]) == 2
