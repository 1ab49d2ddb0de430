"""A GRPO run killed with SIGKILL (kill -9) at a random point, then rerun with
``train.resume=auto``, ends as the uninterrupted run does, exactly, on the CPU: the same
prompts in the same order, the same completions (every token id and its sampling
log-probability), rewards, losses, gradient norms, KL to the reference (a frozen copy of
the starting weights, which a resume must not take from the checkpoint) and final
weights. The point is drawn at random from: a token of a step's rollout, just after a
step's update, and the middle of a checkpoint's write; the assertion messages name it,
and ``LMFORGE_TEST_KILL=WHERE:STEP:N`` replays it."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.grpo_prompts import sum_records, write_prompts
from helpers.preference_data import model_dir
from helpers.runs import read_metrics, weights_digest

pytestmark = pytest.mark.slow
WORKER = Path(__file__).parents[1] / "helpers" / "grpo_kill_worker.py"
STEPS, CHECKPOINT_EVERY, COMPLETION_TOKENS = 5, 2, 8
# metrics that measure the machine (seconds, rates, memory), not the run
MACHINE = ("time/", "tokens_per_s", "tflops", "mfu", "peak_mem", "peak_reserved")


def kill_points() -> list[str]:
    """Every point the test may kill at: WHERE:STEP:N (N: the rollout's token)."""
    saves = [s for s in range(1, STEPS + 1) if s % CHECKPOINT_EVERY == 0 or s == STEPS]
    return ([f"rollout:{s}:{n}" for s in range(1, STEPS + 1)
             for n in range(1, COMPLETION_TOKENS + 2)]
            + [f"update:{s}:0" for s in range(1, STEPS + 1)]
            + [f"save:{s}:0" for s in saves])


@pytest.fixture(scope="module")
def overrides(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("grpo-kill")
    data = root / "prompts.jsonl"
    write_prompts(data, sum_records(24))
    return [f"model.init_from={model_dir(root)}", "data.kind=prompts", f"data.path={data}",
            "data.seq_len=48", "data.micro_batch_size=2", "data.global_batch_size=4",
            "rl.num_generations=3", f"rl.max_completion_length={COMPLETION_TOKENS}",
            "rl.rewards=exact_answer,length", "rl.reward_weights=[1.0, 0.1]",
            "rl.beta=0.04", "rl.temperature=1.0", f"train.max_steps={STEPS}",
            f"train.checkpoint_every={CHECKPOINT_EVERY}", "train.log_every=1",
            f"train.eval_every={STEPS}", "train.eval_batches=1", "train.log_sample_ids=true",
            "train.deterministic=true", "train.device=cpu", "train.sample_tokens=2",
            "train.progress_bar=false", "train.threads=1", "optim.lr=1e-2",
            "optim.warmup_steps=0",
            "train.resume=auto"]  # (every run: the same command requeued, as a cluster does)


def _run(out: Path, overrides: list[str], kill: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "LMFORGE_TEST_COMPLETIONS": str(out.parent / f"{out.name}.completions.jsonl"),
           "LMFORGE_TEST_KILL": kill}
    return subprocess.run([sys.executable, str(WORKER), "train", *overrides,
                           f"train.output_dir={out}"], capture_output=True, text=True,
                          env=env, timeout=600)


def _completions(out: Path) -> dict:
    """(step, the prompts' stream indices) -> what the rollout sampled; a step rerun after
    the kill must sample what it sampled before, so each key keeps one value."""
    seen: dict = {}
    for line in (out.parent / f"{out.name}.completions.jsonl").read_text().splitlines():
        r = json.loads(line)
        key = (r.pop("step"), tuple(r.pop("sample_ids")))
        assert seen.setdefault(key, r) == r, f"step {key[0]} sampled twice, differently"
    return seen


def _run_values(record: dict) -> dict:
    return {k: v for k, v in record.items() if not any(m in k for m in MACHINE)}


@pytest.fixture(scope="module")
def uninterrupted(overrides, tmp_path_factory):
    out = tmp_path_factory.mktemp("whole") / "run"
    proc = _run(out, overrides)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return out


def test_a_grpo_run_killed_at_a_random_point_resumes_to_the_uninterrupted_run(
        overrides, uninterrupted, tmp_path):
    point = os.environ.get("LMFORGE_TEST_KILL") or random.SystemRandom().choice(kill_points())
    where = f"killed at {point} (replay: LMFORGE_TEST_KILL={point})"
    out = tmp_path / "run"
    killed = _run(out, overrides, kill=point)
    assert killed.returncode == -9, f"{where}: {(killed.stdout + killed.stderr)[-3000:]}"
    assert "killing itself (SIGKILL)" in killed.stdout, where
    resumed = _run(out, overrides)
    assert resumed.returncode == 0, f"{where}: {(resumed.stdout + resumed.stderr)[-3000:]}"

    whole, parts = read_metrics(uninterrupted), read_metrics(out)
    assert [r["step"] for r in parts] == list(range(1, STEPS + 1)), where
    for a, b in zip(whole, parts):
        assert _run_values(a) == _run_values(b), f"{where}: step {a['step']} differs"
    assert "eval_reward" in parts[-1] and "kl" in parts[-1], where
    expected, got = _completions(uninterrupted), _completions(out)
    assert set(got) == set(expected), where
    for key in expected:
        assert got[key] == expected[key], f"{where}: the completions of step {key[0]} differ"
    assert weights_digest(out) == weights_digest(uninterrupted), where


def test_every_kill_point_is_a_point_of_the_run():
    """The draw covers each step's rollout (every token, and past the last), each step's
    update and each checkpoint the run writes, the final one included."""
    points = kill_points()
    assert len(points) == len(set(points))
    assert {p.split(":")[0] for p in points} == {"rollout", "update", "save"}
    assert [p for p in points if p.startswith("save")] == ["save:2:0", "save:4:0", "save:5:0"]
