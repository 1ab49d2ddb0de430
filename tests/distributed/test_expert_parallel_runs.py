"""Preference (DPO) and GRPO runs under expert parallelism (issue 46: ``parallel.ep=2
parallel.dp_shard=2``, each MoE layer's 8 experts split 4 + 4 over the two ranks, tokens
dispatched by all-to-all) equal one process for 3 steps (1e-5), on a tiny Qwen3-MoE made
by transformers (helpers.moe_rl): DPO's loss, gradient norm and TRL's reward metrics with
a live frozen reference (itself expert-parallel) and with a precomputed one; GRPO's
losses, gradient norms, rewards, advantages' outcomes (TRL's token metrics, the KL to a
frozen reference, rl.scale_rewards=batch) and the held-out reward. In make test-long
too, against one process: LoRA on the attention and the experts under ep=2 (the
reference: the adapters off), ep=2 inside dp_shard=4 (4 processes, each experts module
FSDP-sharded over the 2 ranks that hold the same experts) and ep=2 dp_shard=2 x tp=2 with
sequence parallelism (the attention split, the experts whole on each tp rank), for DPO
and GRPO, and GRPO under HSDP (2 replicas of ep=2 dp_shard=2); and a DPO run (precomputed
reference) and a GRPO run under ep stopped after step 2 and resumed, which log the
straight runs' losses bit for bit.

The GRPO rollout decodes each rank's own prompts, and every MoE forward under ep is a
collective (an all-to-all of the tokens), so a rank whose completions have all ended must
keep calling the model until every rank is done (``generate(group=...)``,
``models.decode_parallel.all_done``). Its model's stop tokens are made likely, so that
completions end at different lengths: in a rollout (step 1's) one rank's all end within
the first 16 tokens (the decoder looks at the stop flags every 16) while the other's run to the limit
of 24; every rank runs as many forwards as the longest (recorded by
helpers/rollout_worker.py), every MoE layer dispatching (the CPU decode's packed experts,
``models.packed_linear``, leave expert-parallel ones alone: their stacks are DTensors and
their class the dispatching one), and the run equals one process. The decoder alone
(helpers/ep_decode.py, 7 s): one rank's rows end after 2 tokens, the other's after 12,
each decodes what the whole model does alone (its experts packed), both running 12
forwards a decode.

A rank killed mid-run (SIGKILL after step 5) ends the attempt; torchrun restarts the
group, which resumes from step 4's checkpoint with the losses of one process and ends
with its weights (``long``, as its sibling in test_multinode.py)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from helpers.grpo_prompts import grpo_overrides, sum_records, write_prompts
from helpers.moe_rl import moe_model_dir
from helpers.preference_data import pairs, write_pairs
from helpers.runs import launch_worker, read_metrics, run_lmforge, tiny_overrides

pytestmark = pytest.mark.slow
STEPS = 3
EP = ["parallel.dp_shard=2", "parallel.ep=2"]
DPO_KEYS = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins",
            "rewards/accuracies", "logps/chosen", "logps/rejected", "moe/aux_loss",
            "moe/load_max_over_mean")
GRPO_KEYS = ("loss", "grad_norm", "reward", "reward_std", "rewards/vowels/mean",
             "rewards/exact_answer/mean", "kl", "completions/mean_length",
             "completions/min_length", "completions/max_length",
             "completions/clipped_ratio", "frac_reward_zero_std", "entropy",
             "clip_ratio/region_mean", "clip_ratio/low_min", "clip_ratio/high_max",
             "completion_tokens", "moe/aux_loss", "moe/load_max_over_mean")
COMPLETION = 24  # rl.max_completion_length: beyond the decoder's first look at 16 tokens
SYNC_EVERY = 16  # (models.generate.SYNC_EVERY)
ROLLOUT_WORKER = Path(__file__).resolve().parents[1] / "helpers" / "rollout_worker.py"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep-runs")
    return {"root": root, "one": {}, "model": moe_model_dir(root / "model", stop_logit=9.0),
            "pairs": write_pairs(root / "pairs.jsonl", pairs(48)),
            "prompts": write_prompts(root / "prompts.jsonl", sum_records(40))}


def _close(got: list[dict], want: list[dict], keys) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, STEPS + 1))
    for g, w in zip(got, want):
        assert {"loss", "grad_norm", "moe/aux_loss"} <= w.keys()
        for key in keys:
            if key in w or key in g:  # (rl.loss_type=grpo counts completions, not tokens)
                assert g.get(key) == pytest.approx(w.get(key), rel=1e-5, abs=1e-6), (
                    g["step"], key, g.get(key), w.get(key))


def _dpo(inputs, *extra: str) -> list[str]:
    return [f"model.init_from={inputs['model']}", "data.kind=preference",
            f"data.path={inputs['pairs']}", "data.seq_len=48", "data.micro_batch_size=2",
            "data.global_batch_size=8", "data.eval_fraction=0", f"train.max_steps={STEPS}",
            "train.log_every=1", "train.save=false", "optim.lr=1e-3",
            "optim.warmup_steps=0", "train.device=cpu", "train.sample_tokens=1",
            "train.deterministic=true", *extra]


def _one_process(inputs, kind: str, overrides: list[str]) -> list[dict]:
    """The metrics of the one-process run of ``overrides``, once per module."""
    key = (kind, *overrides)
    if key not in inputs["one"]:
        out = inputs["root"] / f"one-{kind}-{len(inputs['one'])}"
        run_lmforge(out, overrides)
        inputs["one"][key] = read_metrics(out)
    return inputs["one"][key]


LONG = pytest.mark.long  # (make test-long: 2 processes over 20 s, or 4)
LORA = ["lora.enabled=true", "lora.rank=4", "lora.targets=all-linear"]
EP_EFSDP = ["parallel.dp_shard=4", "parallel.ep=2"]  # (experts FSDP-sharded over 2 too)
EP_TP = [*EP, "parallel.tp=2", "parallel.sequence_parallel=true"]  # (attention split)
DPO_CASES = {  # name: (processes, the run, the layout)
    "live": (2, ["train.reference=live"], EP),
    "precomputed": (2, ["train.reference=precomputed"], EP),
    "lora": (2, [*LORA, "optim.lr=1e-2"], EP),  # (the reference: the adapters off)
    "ep2_efsdp2": (4, ["train.reference=live"], EP_EFSDP),
    "ep2_tp2_sp": (4, ["train.reference=live"], EP_TP),
}


@pytest.mark.parametrize("case", [pytest.param(c, marks=[] if c == "live" else [LONG])
                                  for c in DPO_CASES])
def test_dpo_under_expert_parallel_equals_one_process(inputs, tmp_path, case):
    nproc, extra, layout = DPO_CASES[case]
    want = _one_process(inputs, "dpo", _dpo(inputs, *extra))
    run_lmforge(tmp_path / "ep", _dpo(inputs, *extra, *layout), nproc=nproc)
    _close(read_metrics(tmp_path / "ep"), want, DPO_KEYS)


def _grpo(inputs, *extra: str) -> list[str]:
    return grpo_overrides(inputs["model"], inputs["prompts"], STEPS,
                          "data.eval_fraction=0.125", f"rl.max_completion_length={COMPLETION}",
                          "rl.beta=0.04", "rl.scale_rewards=batch", *extra)


def _recorded_run(out: Path, overrides: list[str], nproc: int) -> list[list[dict]]:
    """``lmforge train`` under torchrun through helpers/rollout_worker.py: each rank's
    rollouts (one record per decode: its completions' lengths, the model's forwards)."""
    rollouts = out / "rollouts"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "LMFORGE_TEST_ROLLOUTS": str(rollouts)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={nproc}", str(ROLLOUT_WORKER), "train",
                           *overrides, f"train.output_dir={out}"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return [[json.loads(line) for line in (rollouts / f"rank-{r}.jsonl").open()]
            for r in range(nproc)]


def test_grpo_under_expert_parallel_equals_one_process_with_ranks_ending_apart(inputs,
                                                                              tmp_path):
    one = _recorded_run(tmp_path / "one", _grpo(inputs), nproc=1)[0]
    # (one process decodes with its experts packed: the count below can see them)
    assert [(c["dispatching"], c["packed"]) for c in one] == [(0, 2)] * len(one), one
    ranks = _recorded_run(tmp_path / "ep", _grpo(inputs, *EP, "parallel.timeout_s=60"),
                          nproc=2)  # (a rank left waiting: an error in a minute, no hang)
    got, want = read_metrics(tmp_path / "ep"), read_metrics(tmp_path / "one")
    _close(got, want, GRPO_KEYS)
    assert got[-1]["eval_prompts"] == want[-1]["eval_prompts"] == 5
    assert got[-1]["eval_reward"] == pytest.approx(want[-1]["eval_reward"], rel=1e-5)
    # (3 steps' rollouts of one micro-batch each on each rank, then 2 held-out batches)
    assert len(ranks[0]) == len(ranks[1]) == STEPS + 2, ranks
    for calls in zip(*ranks):
        # every rank as many forwards as the longest decode needs: the prefill and a step
        # for each token but the last
        longest = max(max(c["lengths"]) for c in calls)
        assert [c["forwards"] for c in calls] == [min(-(-longest // SYNC_EVERY)
                                                      * SYNC_EVERY, COMPLETION)] * 2, calls
        # both MoE layers dispatching, none through the packed (whole-expert) products
        assert [(c["dispatching"], c["packed"]) for c in calls] == [(2, 0)] * 2, calls
    # a rollout (step 1's, measured) where one rank was done long before the other
    apart = [[max(c["lengths"]) for c in calls] for calls in zip(*ranks)]
    assert any(min(a) < SYNC_EVERY and max(a) == COMPLETION for a in apart), apart
    assert min(r["completions/min_length"] for r in want) < SYNC_EVERY  # (one process too)


def test_ranks_ending_apart_decode_under_expert_parallel_as_one_process(tmp_path):
    """The decoder alone (helpers/ep_decode.py): rank 0's rows end after 2 tokens, rank
    1's after 12; both run 12 forwards a decode (greedy, then sampled), and each decodes
    what the whole model does alone, whose experts were packed (both MoE layers')."""
    launch_worker(Path(__file__).resolve().parents[1] / "helpers" / "ep_decode.py",
                  tmp_path, nproc=2)
    result = json.loads((tmp_path / "ep-decode.json").read_text())
    assert result["lengths"] == [2, 12], result
    assert result["forwards"] == [24, 24], result  # (the prefill and 11 steps, twice)
    assert result["same_tokens"] and result["max_logprob_diff"] < 1e-5, result
    assert result["packed"] == [0, 0] and result["packed_alone"] == [2, 2], result


GRPO_CASES = {  # name: (processes, the run, the layout)
    "lora": (2, [*LORA, "rl.beta=0.1", "rl.loss_type=grpo"], EP),
    # (1 prompt a micro-batch: 4 ranks of data; one process takes the step's 4 in turn)
    "ep2_efsdp2": (4, ["data.micro_batch_size=1"], EP_EFSDP),
    # (the rollout's group: every data-parallel rank, the replicas' too)
    "ep2_hsdp2": (4, ["data.micro_batch_size=1"], ["parallel.dp_replicate=2", *EP]),
    # (the decoder pads each forward's tokens to a multiple of tp)
    "ep2_tp2_sp": (4, [], EP_TP),
}


@pytest.mark.long  # (make test-long: LoRA, and 4 processes)
@pytest.mark.parametrize("case", list(GRPO_CASES))
def test_grpo_on_another_expert_parallel_layout_equals_one_process(inputs, tmp_path, case):
    nproc, extra, layout = GRPO_CASES[case]
    want = _one_process(inputs, "grpo", _grpo(inputs, *extra))
    run_lmforge(tmp_path / "ep", _grpo(inputs, *extra, *layout), nproc=nproc)
    got = read_metrics(tmp_path / "ep")
    _close(got, want, GRPO_KEYS)
    assert got[-1]["eval_reward"] == pytest.approx(want[-1]["eval_reward"], rel=1e-5)


@pytest.mark.long  # (make test-long: 3 launches of 2 processes, 27-40 s)
@pytest.mark.parametrize("kind", ["dpo", "grpo"])
def test_a_run_under_expert_parallel_stopped_and_resumed_logs_the_straight_losses(
        inputs, tmp_path, kind):
    """Stopped after step 2 (its checkpoint) and resumed: DPO with a precomputed
    reference (read back, not scored again), GRPO (each completion seeded by its step
    and prompt, so the resumed rollouts are the straight run's) bit for bit."""
    steps = ["train.max_steps=4", "train.checkpoint_every=2", "train.save=true", *EP]
    base = (_dpo(inputs, "train.reference=precomputed", *steps) if kind == "dpo"
            else _grpo(inputs, *steps))
    straight, split = tmp_path / "straight", tmp_path / "split"
    run_lmforge(straight, base, nproc=2)
    run_lmforge(split, [*base, "train.stop_at_step=2"], nproc=2)
    run_lmforge(split, [*base, "train.resume=auto"], nproc=2)
    keys = ("step", "loss", "grad_norm", "reward", "completions/mean_length")
    got, want = ([tuple(r.get(k) for k in keys) for r in read_metrics(run)]
                 for run in (split, straight))
    assert [r[0] for r in got] == [1, 2, 3, 4] and got == want


# ---------------------------------------------------------------- a lost rank, restarted

KILL_STEPS = 6


def _moe_text(corpus: Path) -> list[str]:
    """The 16-expert qwen3-moe-debug (layers of the tiny shape) on the tiny corpus."""
    return ["model.preset=qwen3-moe-debug", *tiny_overrides(corpus, KILL_STEPS),
            "train.deterministic=true", "train.progress_bar=false"]


@pytest.mark.long  # (make test-long: about a minute, most of it the group's restart)
def test_a_killed_rank_under_expert_parallel_restarts_the_group_which_resumes_alike(
        tiny_corpus, tmp_path):
    base = _moe_text(tiny_corpus)
    run_lmforge(tmp_path / "one", base)
    out = tmp_path / "run"
    start = time.time()
    proc = run_lmforge(out, [*base, *EP, "train.checkpoint_every=2", "train.resume=auto",
                             "parallel.timeout_s=60"], nproc=2, fault="die:1:5",
                       timeout=900, check=False, torchrun_args=["--max-restarts=1"])
    seconds = time.time() - start
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, said[-4000:]
    assert "killing itself (SIGKILL)" in said
    lines = [line for line in proc.stderr.splitlines()
             if "lmforge: error: rank 0: a collective" in line]
    assert len(lines) == 1 and "another rank died" in lines[0], said[-4000:]
    assert re.search(r"failed \(exitcode: -9\) local_rank: 1 ", said), said[-4000:]
    assert "(step 4)" in said, said[-4000:]  # "resumed from ... (step 4)"
    got, want = read_metrics(out), read_metrics(tmp_path / "one")
    assert [r["step"] for r in got] == list(range(1, KILL_STEPS + 1))  # each step once
    for g, w in zip(got, want):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5), g["step"]
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-5), g["step"]
    assert seconds < 600  # no hang: the group ended and restarted by itself
    weights, ref = (load_file(run / "hf" / "model.safetensors") for run in (out, tmp_path / "one"))
    assert weights.keys() == ref.keys() and any(".mlp.experts." in k for k in ref)
    for name, want in ref.items():  # (the experts gathered whole from both ranks)
        assert (weights[name] - want).abs().max() <= 1e-4 * want.abs().max(), name
