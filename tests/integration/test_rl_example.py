"""examples/rl/run.sh end to end on the CPU (shortened): a tokenizer, SFT of a tiny Llama
from scratch (the answer's form, colours at random), then GRPO with the example's own
reward function (a user file, rl.rewards=examples/rl/rewards.py:true_colour). The held-out
accuracy (one greedy answer per prompt, scored by that reward) rises clearly, and the run
logged TRL's metrics with the step's time split."""
from __future__ import annotations

import json

import pytest

from helpers.runs import run_example

pytestmark = [pytest.mark.slow, pytest.mark.long]


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    return run_example("rl/run.sh", tmp_path_factory.mktemp("rl-example"), 1200,
                       SFT_STEPS=300, GRPO_STEPS=120)


def test_held_out_accuracy_rises_clearly(example):
    before = json.loads((example / "score-before.json").read_text())
    after = json.loads((example / "score-after.json").read_text())
    assert before["prompts"] == after["prompts"] == 28
    assert before["accuracy"] <= 0.25  # the SFT model: colours at random (1 in 8)
    assert after["accuracy"] >= before["accuracy"] + 0.1


def test_the_grpo_run_logged_its_rewards_time_split_and_the_same_held_out_score(example):
    records = [json.loads(line) for line in (example / "grpo" / "metrics.jsonl").open()]
    for name in ("reward", "rewards/true_colour/mean", "completions/mean_length",
                 "time/generate_s", "time/score_s", "time/train_s"):
        assert name in records[-1], name
    # the trainer's held-out eval_reward (greedy, the same reward) is score.py's figure
    after = json.loads((example / "score-after.json").read_text())
    assert records[-1]["eval_reward"] == pytest.approx(after["accuracy"])
