"""Prompts for GRPO's tests: sums of two digits as plain text and as chat messages, with
their answers (``exact_answer``) and an id field that reaches the rewards untouched, and
the run's overrides on a tiny model directory (helpers.preference_data.model_dir)."""
from __future__ import annotations

import json
from pathlib import Path


def sum_records(n: int) -> list[dict]:
    out = []
    for i in range(n):
        a, b = i % 5, (i * 3) % 7
        prompt = f"What is {a} plus {b}?"
        out.append({"prompt": prompt if i % 2 else [{"role": "user", "content": prompt}],
                    "answer": str(a + b), "id": i})
    return out


def write_prompts(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


VOWELS = f"{Path(__file__).with_name('grpo_rewards.py')}:vowels"


def grpo_overrides(model: Path, data: Path, steps: int, *extra: str) -> list[str]:
    """A short GRPO run: 2 prompts a micro-batch, 4 a step, 3 completions of up to 8
    tokens each, rewarded by exact_answer and the share of vowels (``grpo_rewards``), a
    held-out greedy pass at the end."""
    return [f"model.init_from={model}", "data.kind=prompts", f"data.path={data}",
            "data.seq_len=48", "data.micro_batch_size=2", "data.global_batch_size=4",
            "rl.num_generations=3", "rl.max_completion_length=8",
            f"rl.rewards=exact_answer,{VOWELS}", "rl.reward_weights=1.0,2.0",
            f"train.max_steps={steps}", "train.log_every=1", f"train.eval_every={steps}",
            "train.save=false", "optim.lr=1e-2", "optim.warmup_steps=0", "train.device=cpu",
            "train.sample_tokens=1", "train.deterministic=true", *extra]
