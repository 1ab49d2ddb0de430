"""examples/preference/run.sh end to end on the CPU (shortened): a tokenizer, SFT of a
tiny Llama from scratch, DPO with LoRA against the SFT model (its adapters off). On the
held-out pairs the reward accuracy rises from chance (about 0.5) to clearly above it, and
the trained adapter loads in peft on transformers' model with our logits."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers.runs import run_example
from lmforge.models.hf import load_hf_model
from lmforge.peft.adapters import load_adapter

pytestmark = [pytest.mark.slow, pytest.mark.long]


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    return run_example("preference/run.sh", tmp_path_factory.mktemp("preference-example"),
                       900, SFT_STEPS=300, DPO_STEPS=200)


def _score(path: Path) -> dict:
    return json.loads(path.read_text())


def test_held_out_reward_accuracy_rises_from_chance_to_clearly_above_it(example):
    before, after = _score(example / "eval-before.json"), _score(example / "eval-after.json")
    assert before["pairs"] == after["pairs"] == 200
    assert 0.35 <= before["rewards/accuracies"] <= 0.65  # the SFT model: colours at random
    assert after["rewards/accuracies"] >= 0.8
    dpo = _score(example / "eval-after-dpo.json")
    assert dpo["rewards/accuracies"] >= 0.8 and dpo["rewards/margins"] > 0
    records = [json.loads(line) for line in (example / "dpo" / "metrics.jsonl").open()]
    assert records[-1]["eval_rewards/accuracies"] == pytest.approx(dpo["rewards/accuracies"])


def test_the_dpo_adapter_loads_in_peft_with_our_logits(example):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    base = transformers.AutoModelForCausalLM.from_pretrained(example / "sft" / "hf",
                                                             attn_implementation="eager")
    theirs = peft.PeftModel.from_pretrained(base, example / "dpo" / "adapter").eval()
    ours = load_hf_model(example / "sft" / "hf")
    load_adapter(ours, example / "dpo" / "adapter")
    tokens = torch.randint(0, ours.args.vocab_size, (2, 24),
                           generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(tokens), theirs(tokens).logits,
                                   rtol=1e-4, atol=1e-4)
