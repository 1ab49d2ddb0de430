"""A (tiny) fine-tuning run from a Hugging Face model directory with no optimizer settings:
it trains at the fine-tuning LR, records itself by its init_from, samples from the first
held-out prompt, and prints and records the SFT samples it had to cut."""
import json

import pytest
import yaml

from lmforge.config import load_config
from lmforge.config.defaults import FULL_FINE_TUNING_LR
from lmforge.data.tokenizer import load_tokenizer
from lmforge.models.hf import save_hf_model
from lmforge.train.loop import train

from helpers.real_tokenizers import save_tokenizer
from helpers.tiny_models import tiny_llama


def _model_dir(root):
    """A tiny random Llama with a ChatML tokenizer, as a Hugging Face directory."""
    tokenizer = load_tokenizer(save_tokenizer("chatml", root / "tokenizer"))
    return save_hf_model(tiny_llama(vocab_size=tokenizer.vocab_size), root / "base",
                         tokenizer=tokenizer)


def test_a_fine_tuning_run_uses_the_fine_tuning_defaults(tmp_path, capsys):
    model_dir = _model_dir(tmp_path)
    long_answer = " ".join(["the sky is blue and the ground below is green"] * 6)
    records = [{"prompt": "say hi", "response": "hello there"},
               {"prompt": "tell me about tokens", "response": long_answer}] * 4
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "val.jsonl").write_text(json.dumps({"prompt": "what is up",
                                                    "response": "the sky"}) + "\n")
    out = tmp_path / "run"
    cfg = load_config(None, [
        f"model.init_from={model_dir}", "data.kind=sft", f"data.path={tmp_path / 'train.jsonl'}",
        f"data.eval_path={tmp_path / 'val.jsonl'}", "data.seq_len=24",
        "data.micro_batch_size=2", "train.max_steps=2", "train.eval_batches=1",
        "train.sample_tokens=2", f"train.output_dir={out}", "train.progress_bar=false",
        "train.device=cpu"])
    summary = train(cfg)
    stdout = capsys.readouterr().out
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["lr"] == pytest.approx(FULL_FINE_TUNING_LR)  # warmup: 1 step (3%)
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["model"]["preset"] is None and saved["model"]["init_from"] == str(model_dir)
    # the 4 long samples were cut, said in one line and recorded in summary.json
    recorded = json.loads((out / "summary.json").read_text())
    assert recorded["sft_truncated_samples"] == summary["sft_truncated_samples"] == 4
    assert recorded["sft_truncated_tokens"] > 0
    assert "SFT data: 4 of 8 samples are longer than seq_len + 1 = 25 tokens" in stdout
    assert "prompt from the first sample of" in stdout
    assert summary["sample"].startswith("<|im_start|>user\nwhat is up<|im_end|>\n"
                                        "<|im_start|>assistant\n")
    assert "def " not in summary["sample"]
