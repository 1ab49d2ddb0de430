"""`lmforge lora merge` and `lmforge eval-sft` (alias `lora eval`) end to end on a tiny
saved model."""
from __future__ import annotations

import json

import torch

from lmforge.cli import build_parser, main
from lmforge.data.tokenizer import train_bpe
from lmforge.models.hf import load_hf_model, save_hf_model
from lmforge.peft import apply_lora, save_adapter

from helpers import peft_models


def _saved_model_and_adapter(tmp_path):
    records = [{"prompt": f"Dialogue:\nA: hello {i}\nSummary:", "response": f"A greets {i}."}
               for i in range(4)]
    data = tmp_path / "valid.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    tok = train_bpe([json.dumps(r) for r in records] * 20, 300)
    args = peft_models.TINY.__class__(**{**peft_models.TINY.__dict__, "vocab_size": tok.vocab_size})
    save_hf_model(peft_models.tiny_model(args), tmp_path / "base", tokenizer=tok)
    model = load_hf_model(tmp_path / "base")
    apply_lora(model, peft_models.lora_cfg())
    peft_models.randomize_adapters(model)
    save_adapter(model, tmp_path / "adapter", base_model_path=str(tmp_path / "base"))
    return model, data


def test_lora_commands_are_registered():
    help_text = build_parser().format_help()
    assert "lora" in help_text


def test_lora_merge_writes_a_model_equal_to_base_plus_adapter(tmp_path, capsys):
    model, _ = _saved_model_and_adapter(tmp_path)
    assert main(["lora", "merge", "--model", str(tmp_path / "base"), "--adapter",
                 str(tmp_path / "adapter"), "--output", str(tmp_path / "merged")]) == 0
    merged = load_hf_model(tmp_path / "merged").eval()
    assert (tmp_path / "merged" / "tokenizer.json").is_file()
    x = peft_models.tokens(seq=8) % merged.args.vocab_size
    with torch.no_grad():
        assert peft_models.max_rel_err(merged(x), model.eval()(x)) < 1e-5


def test_eval_sft_scores_a_model_with_and_without_adapter_and_lora_eval_is_its_alias(
        tmp_path, capsys):
    _, data = _saved_model_and_adapter(tmp_path)
    results = {}
    for command in (["eval-sft"], ["lora", "eval"]):
        for extra in ([], ["--adapter", str(tmp_path / "adapter")]):
            out = tmp_path / f"{command[-1]}{len(extra)}.json"
            assert main([*command, "--model", str(tmp_path / "base"), "--data", str(data),
                         "--max-new-tokens", "3", "--output", str(out), *extra]) == 0
            result = json.loads(out.read_text())
            assert result["samples"] == 4 and 0 <= result["rouge_l"] <= 1
            assert result["adapter"] == (extra[1] if extra else None)
            results[command[-1], len(extra)] = result
    for with_adapter in (0, 2):  # the alias runs the same evaluation
        assert results["eval", with_adapter] == results["eval-sft", with_adapter]
    assert results["eval-sft", 0]["loss"] != results["eval-sft", 2]["loss"]
    assert main(["eval-sft", "--model", str(tmp_path / "base"), "--data",
                 str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl" in capsys.readouterr().err


_CHAT = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|end_of_text|>"
         "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")


def test_generate_with_an_adapter_equals_generate_on_the_merged_model(tmp_path, capsys):
    """Greedy, with and without --chat: the adapter is applied as `lora merge` applies it."""
    _saved_model_and_adapter(tmp_path)
    config = json.loads((tmp_path / "base" / "tokenizer_config.json").read_text())
    (tmp_path / "base" / "tokenizer_config.json").write_text(
        json.dumps({**config, "chat_template": _CHAT}))
    assert main(["lora", "merge", "--model", str(tmp_path / "base"), "--adapter",
                 str(tmp_path / "adapter"), "--output", str(tmp_path / "merged")]) == 0
    capsys.readouterr()

    def generated(model, *extra):
        assert main(["generate", "--model", str(tmp_path / model), "--prompt", "A: hello 2",
                     "--greedy", "--max-new-tokens", "12", *extra]) == 0
        return capsys.readouterr().out

    for chat in ([], ["--chat"]):
        with_adapter = generated("base", "--adapter", str(tmp_path / "adapter"), *chat)
        assert with_adapter == generated("merged", *chat)
        assert with_adapter != generated("base", *chat)  # the adapter matters
