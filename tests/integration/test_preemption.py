"""The scheduler's warning, end to end on the CPU: SIGUSR1 sent to `lmforge train` mid-run
ends it after the step in progress with a committed checkpoint and exit status 75, and
``train.resume=auto`` then continues bit-exactly."""
import os
import signal
import subprocess
import sys

import pytest
import torch

from helpers import runs
from helpers.runs import await_pid, read_metrics, run_lmforge, tiny_overrides
from lmforge.checkpoint import is_complete
from lmforge.cli import main
from lmforge.train.preempt import PREEMPTED_EXIT_CODE

pytestmark = pytest.mark.slow
tiny_corpus = runs.tiny_corpus  # the session fixture


def train_here(out, overrides) -> None:
    """`lmforge train` in this process (no interpreter start-up), on one thread as the
    subprocesses run, restoring the thread count after."""
    threads = torch.get_num_threads()
    try:
        assert main(["train", *overrides, "train.threads=1", f"train.output_dir={out}"]) == 0
    finally:
        torch.set_num_threads(threads)


def test_sigusr1_mid_run_checkpoints_exits_75_and_resumes_bit_exactly(tiny_corpus, tmp_path,
                                                                      capsys):
    # No periodic or final checkpoint: the one the signal writes is the only one.
    base = tiny_overrides(tiny_corpus, 6) + ["train.deterministic=true", "train.save=false",
                                             "train.checkpoint_every=0"]
    split, ready = tmp_path / "split", tmp_path / "at-step-3"
    proc = run_lmforge(split, base, fault="await_stop:3", background=True,
                       env={"LMFORGE_TEST_SIGNAL": str(ready)})
    os.kill(await_pid(ready, proc), signal.SIGUSR1)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == PREEMPTED_EXIT_CODE, stderr[-3000:]
    assert ("preempted at step 3: checkpoint written, exiting; requeue resumes "
            "(train.resume=auto)") in stdout
    checkpoints = sorted((split / "checkpoints").iterdir())
    assert [p.name for p in checkpoints] == ["step-0000003"] and is_complete(checkpoints[0])
    assert [r["step"] for r in read_metrics(split)] == [1, 2, 3]

    train_here(split, base + ["train.resume=auto"])
    assert "resumed from" in capsys.readouterr().out
    straight = tmp_path / "straight"
    train_here(straight, base)
    assert [r["step"] for r in read_metrics(split)] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in read_metrics(split)] == [r["loss"] for r in
                                                         read_metrics(straight)]


def test_ctrl_c_mid_run_stops_as_sigterm_does(tiny_corpus, tmp_path):
    """SIGINT (Ctrl-C) sent to `lmforge train` after step 2: the line saying so at once,
    step 2's checkpoint, the preemption line and exit status 75, no traceback."""
    out, ready = tmp_path / "run", tmp_path / "at-step-2"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "LMFORGE_TEST_FAULT": "await_stop:2", "LMFORGE_TEST_SIGNAL": str(ready)}
    overrides = tiny_overrides(tiny_corpus, 6) + ["train.save=false", "train.checkpoint_every=0"]
    # (SIGINT as at a terminal: a test runner in the background may have it ignored)
    proc = subprocess.Popen([sys.executable, str(runs.WORKER), "train", *overrides,
                             f"train.output_dir={out}"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    os.kill(await_pid(ready, proc), signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == PREEMPTED_EXIT_CODE, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    assert "lmforge: SIGINT received: stopping after this step, then a checkpoint" in stderr
    assert "preempted at step 2: checkpoint written, exiting" in stdout
    checkpoints = sorted((out / "checkpoints").iterdir())
    assert [p.name for p in checkpoints] == ["step-0000002"] and is_complete(checkpoints[0])
    assert [r["step"] for r in read_metrics(out)] == [1, 2]
