"""GRPO on every layout it runs in equals one process for 3 steps (1e-5): the losses,
gradient norms, rewards, completion lengths, TRL's token metrics and the held-out reward
of a run whose rollout samples with the policy as it is sharded (each data-parallel rank
its own prompts, every rank decoding until all are done), the step's advantages (with
rl.scale_rewards=batch: the whole step's std) and normalisation over every rank.
FSDP2 over two ranks with full weights (the reference a frozen sharded copy) and with
LoRA (the reference the adapters-off model), DDP, tensor parallelism over two ranks with
and without sequence parallelism (the decoder pads a forward's tokens to a multiple of
tp), FSDP2 x tp over four, and rl.num_iterations=2 under FSDP2. (QLoRA runs in one
process only, and LoRA not under tensor parallelism: both refused before any step,
lmforge.config.schema; QLoRA's one-process run: tests/unit/train/test_grpo_training.py.) The decoder alone: ranks whose
prompts end after different numbers of tokens decode what each would alone."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.grpo_prompts import grpo_overrides, sum_records, write_prompts
from helpers.preference_data import model_dir
from helpers.runs import read_metrics, run_lmforge

pytestmark = pytest.mark.slow
STEPS = 3
KEYS = ("loss", "grad_norm", "reward", "reward_std", "rewards/vowels/mean", "kl",
        "completions/mean_length", "completions/clipped_ratio", "frac_reward_zero_std",
        "entropy", "clip_ratio/region_mean", "clip_ratio/low_min", "clip_ratio/high_max",
        "completion_tokens")
FULL = ["rl.beta=0.04", "rl.scale_rewards=batch"]
LORA = ["lora.enabled=true", "lora.rank=4", "lora.targets=all-linear", "rl.beta=0.1",
        "rl.loss_type=grpo"]
ITERATIONS = ["rl.num_iterations=2", "rl.beta=0.04", "rl.epsilon=0.05"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo-dist")
    # 40 prompts, 5 held out: over 2 ranks of 2 the second held-out batch leaves rank 1
    # past the last prompt (it decodes fillers, not scored)
    data = write_prompts(root / "prompts.jsonl", sum_records(40))
    return {"model": model_dir(root, "llama3"), "data": data, "root": root, "one": {}}


def _one_process(inputs, name: str, extra: list[str]) -> list[dict]:
    """The one-process run of ``extra``, once per module."""
    if name not in inputs["one"]:
        out = inputs["root"] / f"one-{name}"
        run_lmforge(out, _overrides(inputs, *extra))
        inputs["one"][name] = read_metrics(out)
    return inputs["one"][name]


def _overrides(inputs, *extra: str) -> list[str]:
    return grpo_overrides(inputs["model"], inputs["data"], STEPS, "data.eval_fraction=0.125",
                          *extra)


def _close(got: list[dict], want: list[dict], keys=KEYS) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, STEPS + 1))
    for g, w in zip(got, want):
        for key in keys:
            if key in w or key in g:
                assert g.get(key) == pytest.approx(w.get(key), rel=1e-5, abs=1e-6), (
                    g["step"], key, g.get(key), w.get(key))
    assert got[-1]["eval_prompts"] == want[-1]["eval_prompts"] == 5
    assert got[-1]["eval_reward"] == pytest.approx(want[-1]["eval_reward"], rel=1e-5)


LAYOUTS = {  # name: (processes, which one-process run, its keys, the layout)
    "fsdp2_full": (2, "full", FULL, ["parallel.dp_shard=2"]),
    "fsdp2_lora": (2, "lora", LORA, ["parallel.dp_shard=2"]),
    "tp2_sp_full": (2, "full", FULL, ["parallel.tp=2", "parallel.dp_shard=1",
                                      "parallel.sequence_parallel=true"]),
    "fsdp2_num_iterations_2": (2, "iterations", ITERATIONS, ["parallel.dp_shard=2"]),
    "ddp_full": (2, "full", FULL, ["parallel.dp_replicate=2", "parallel.dp_shard=1"]),
    "tp2_no_sp_full": (2, "full", FULL, ["parallel.tp=2", "parallel.dp_shard=1",
                                         "parallel.sequence_parallel=false"]),
    "fsdp2_tp2_sp_full": (4, "full", FULL, ["parallel.tp=2", "parallel.dp_shard=2"]),
}
# make test-long: the other data-parallel wrapper, tp without sp, 4 processes and
# num_iterations 2 (make test holds FSDP2 full and LoRA, and tp + sp; num_iterations 2 in
# one process: tests/unit/train/test_grpo_training.py). LoRA under tp is refused for every
# objective (parallel.tp), and QLoRA beyond one process.
LONG = {"ddp_full", "tp2_no_sp_full", "fsdp2_tp2_sp_full", "fsdp2_num_iterations_2"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.long] if n in LONG
                                               else []) for n in LAYOUTS])
def test_a_grpo_layout_equals_one_process_for_three_steps(inputs, tmp_path, name):
    nproc, one, extra, layout = LAYOUTS[name]
    want = _one_process(inputs, one, extra)
    run_lmforge(tmp_path / name, _overrides(inputs, *extra, *layout), nproc=nproc)
    got = read_metrics(tmp_path / name)
    _close(got, want)
    if one == "iterations":  # (step 2 trains step 1's rollout again: no new prompts)
        assert got[1]["consumed_samples"] == got[0]["consumed_samples"] == 4
        assert got[1]["time/generate_s"] == 0 and "reward" not in got[1]


def test_ranks_decoding_their_own_prompts_or_sequence_parallel_decode_as_one_process(
        tmp_path):
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(root / "src"), str(root / "tests"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node=2", str(root / "tests" / "helpers" /
                                                     "grpo_decode_dp.py"), str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    result = json.loads((tmp_path / "decode-dp.json").read_text())
    assert result["lengths"][0] != result["lengths"][1], result  # (they end apart)
    assert result["same_tokens"], result
    assert result["max_logprob_diff"] < 1e-5, result
