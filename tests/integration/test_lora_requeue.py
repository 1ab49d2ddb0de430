"""A LoRA run killed and requeued, as a cluster does it: SIGTERM (a preempted or timed-out
job) checkpoints the step in progress and exits 75; SIGKILL after a checkpoint loses the
steps since. Either way the same command rerun with ``train.resume=auto`` ends with the
metrics of an uninterrupted run: each step once, the same losses and gradient norms."""
import os
import signal

import pytest

from helpers import runs
from helpers.runs import await_pid, read_metrics, run_lmforge, tiny_overrides
from lmforge.train.preempt import PREEMPTED_EXIT_CODE

pytestmark = pytest.mark.slow
tiny_corpus = runs.tiny_corpus  # the session fixture
STEPS, KILLED_AFTER = 4, 3


@pytest.fixture(scope="module")
def lora_run(tiny_corpus) -> list[str]:
    return tiny_overrides(tiny_corpus, STEPS) + [
        "lora.enabled=true", "lora.rank=4", "lora.targets=all-linear",
        "train.deterministic=true", "train.checkpoint_every=2", "train.save=false"]


@pytest.fixture(scope="module")
def uninterrupted(lora_run, tmp_path_factory) -> list[tuple]:
    out = tmp_path_factory.mktemp("lora") / "straight"
    run_lmforge(out, lora_run)
    return [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(out)]


# The trainer waits for the signal where it asks whether to stop after step 3, before
# it logs that step: SIGTERM lets it log step 3 and checkpoint; SIGKILL loses step 3.
@pytest.mark.parametrize("signum, status, logged, resumed_from", [
    (signal.SIGTERM, PREEMPTED_EXIT_CODE, [1, 2, 3], KILLED_AFTER),
    (signal.SIGKILL, -9, [1, 2], 2)], ids=["sigterm", "sigkill"])
def test_killed_lora_run_requeued_logs_the_uninterrupted_losses(lora_run, uninterrupted,
                                                                tmp_path, signum, status,
                                                                logged, resumed_from):
    out, ready = tmp_path / "run", tmp_path / f"at-step-{KILLED_AFTER}"
    # The step-2 checkpoint is committed by then.
    proc = run_lmforge(out, lora_run, fault=f"await_stop:{KILLED_AFTER}", background=True,
                       env={"LMFORGE_TEST_SIGNAL": str(ready)})
    os.kill(await_pid(ready, proc), signum)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == status, stderr[-3000:]
    assert [r["step"] for r in read_metrics(out)] == logged

    requeued = run_lmforge(out, lora_run + ["train.resume=auto"])
    assert f"resumed from {out / 'checkpoints' / f'step-{resumed_from:07d}'}" in requeued.stdout
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(out)] == uninterrupted
