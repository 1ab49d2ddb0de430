"""Preference training (DPO) in every layout it runs in equals one process step by step
(loss, gradient norm and TRL's reward metrics, 1e-5): FSDP2 over two ranks with a full
weight run's frozen reference copy (sharded like the policy) and with a precomputed
reference, LoRA under FSDP2 (the reference: the model with its adapters off), and tensor
+ sequence parallelism over two ranks (log-probabilities through loss_parallel), packed
too. A run stopped after step 2 and resumed (train.resume=auto) logs the uninterrupted
run's losses, in one process and under FSDP2. A pipeline is refused in one line
(test_bad_inputs): its last stage sees one microbatch's logits at a time."""
from __future__ import annotations

import pytest

import os
import signal

from helpers.preference_data import model_dir, pairs, write_pairs
from helpers.runs import await_pid, read_metrics, run_lmforge

pytestmark = pytest.mark.slow
STEPS = 4
KEYS = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/accuracies",
        "logps/chosen")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pref-dist")
    data = write_pairs(root / "pairs.jsonl", pairs(48))
    return {kind: (model_dir(root, kind), data) for kind in ("chatml", "llama3")}


def overrides(inputs, *extra, kind: str = "chatml") -> list[str]:
    model, data = inputs[kind]
    return [f"model.init_from={model}", "data.kind=preference", f"data.path={data}",
            "data.seq_len=48", "data.micro_batch_size=2", "data.global_batch_size=8",
            "data.eval_fraction=0", f"train.max_steps={STEPS}", "train.log_every=1",
            "train.save=false", "optim.lr=1e-3", "optim.warmup_steps=0",
            "train.device=cpu", "train.sample_tokens=1", "train.deterministic=true", *extra]


def _close(got: list[dict], want: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, STEPS + 1))
    for g, w in zip(got, want):
        for key in KEYS:
            assert g[key] == pytest.approx(w[key], rel=1e-5, abs=1e-6), (g["step"], key)


@pytest.mark.parametrize("case,extra", [
    ("full-live", []),
    ("full-precomputed", ["train.reference=precomputed"]),
    ("lora", ["lora.enabled=true", "lora.targets=all-linear", "optim.lr=1e-2"]),
])
def test_fsdp2_over_two_ranks_equals_one_process(inputs, tmp_path, case, extra):
    one, two = tmp_path / "one", tmp_path / "two"
    run_lmforge(one, overrides(inputs, *extra))
    run_lmforge(two, overrides(inputs, *extra, "parallel.dp_shard=2"), nproc=2)
    _close(read_metrics(two), read_metrics(one))


# (pack=False: make test-long, 14 s; tp with SP over packed rows stays in make test)
@pytest.mark.parametrize("pack", [pytest.param(False, marks=pytest.mark.long), True])
def test_tensor_and_sequence_parallel_over_two_ranks_equals_one_process(inputs, tmp_path,
                                                                        pack):
    extra = [f"data.pack={str(pack).lower()}"]
    one, two = tmp_path / "one", tmp_path / "two"
    run_lmforge(one, overrides(inputs, *extra, kind="llama3"))
    run_lmforge(two, overrides(inputs, *extra, "parallel.tp=2", "parallel.dp_shard=1",
                               kind="llama3"), nproc=2)
    _close(read_metrics(two), read_metrics(one))


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.long)])  # (2: 19 s,
# make test-long; the killed-and-requeued run below covers two processes in make test)
def test_a_preference_run_stopped_and_resumed_logs_the_uninterrupted_losses(inputs, tmp_path,
                                                                          nproc):
    layout = ["parallel.dp_shard=2"] if nproc == 2 else []
    base = overrides(inputs, "train.checkpoint_every=2", "train.save=true",
                     "train.reference=precomputed", *layout)
    straight, split = tmp_path / "straight", tmp_path / "split"
    run_lmforge(straight, base, nproc=nproc)
    run_lmforge(split, [*base, "train.stop_at_step=2"], nproc=nproc)
    run_lmforge(split, [*base, "train.resume=auto"], nproc=nproc)
    got, want = read_metrics(split), read_metrics(straight)
    assert [(r["loss"], r["grad_norm"]) for r in got] == [(r["loss"], r["grad_norm"])
                                                          for r in want]


@pytest.mark.long  # (make test-long: 11 s; the stopped-and-resumed run stays)
def test_a_preference_run_killed_mid_run_and_requeued_logs_the_uninterrupted_losses(
        inputs, tmp_path):
    """kill -9 after step 3 (the step-2 checkpoint committed): step 3 is lost, and the
    requeued run (train.resume=auto) continues from step 2 with the uninterrupted losses;
    the precomputed reference is read back, not scored again with trained weights."""
    base = overrides(inputs, "train.checkpoint_every=2", "train.save=true",
                     "train.reference=precomputed")
    straight, out, ready = tmp_path / "straight", tmp_path / "run", tmp_path / "at-step-3"
    run_lmforge(straight, base)
    proc = run_lmforge(out, base, fault="await_stop:3", background=True,
                       env={"LMFORGE_TEST_SIGNAL": str(ready)})
    os.kill(await_pid(ready, proc), signal.SIGKILL)
    proc.communicate(timeout=300)
    assert proc.returncode == -9
    stored = sorted((out / "reference").iterdir())
    mtimes = [p.stat().st_mtime_ns for p in stored]
    requeued = run_lmforge(out, [*base, "train.resume=auto"])
    assert f"resumed from {out / 'checkpoints' / 'step-0000002'}" in requeued.stdout
    assert [p.stat().st_mtime_ns for p in sorted((out / "reference").iterdir())] == mtimes
    got, want = read_metrics(out), read_metrics(straight)
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in got] == [
        (r["step"], r["loss"], r["grad_norm"]) for r in want]
