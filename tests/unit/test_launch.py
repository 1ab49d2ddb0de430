"""`lmforge launch slurm`: the script survives its time limit and preemption (requeue,
an early warning signal passed down to lmforge, train.resume=auto), and runs in the
project's environment. The script's own signal path runs here in bash, with stand-ins
for srun and scontrol."""
import os
import signal
import subprocess
import sys
import time

import pytest

from lmforge.cli import main
from lmforge.launch import TORCHRUN_SIGNALS, render_slurm_script

LAYOUT = ["model.preset=llama2-7b", "parallel.tp=8", "data.seq_len=4096"]


def write_script(tmp_path, *options, overrides=()) -> str:
    out = tmp_path / "job.sbatch"
    assert main(["launch", "slurm", *LAYOUT, *overrides, "--nodes", "2",
                 "--gpus-per-node", "8", "--output", str(out), *options]) == 0
    return out.read_text()


def test_the_script_requeues_warns_before_the_limit_and_always_resumes(tmp_path):
    script = write_script(tmp_path, "--stop-before", "300", "--env", "none")
    lines = script.splitlines()
    assert "#SBATCH --requeue" in lines and "#SBATCH --open-mode=append" in lines
    assert "#SBATCH --signal=B:USR1@300" in lines  # to this shell, which passes it on
    assert "export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=300" in lines
    assert f"    --signals-to-handle={TORCHRUN_SIGNALS} \\" in lines
    assert "SIGUSR1" in TORCHRUN_SIGNALS.split(",")
    assert "-m lmforge.cli train model.preset=llama2-7b parallel.tp=8 data.seq_len=4096 " \
           "train.resume=auto &" in script
    assert 'scontrol requeue "$SLURM_JOB_ID"' in script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


def test_train_resume_is_auto_once_and_another_resume_path_is_refused(tmp_path, capsys):
    script = write_script(tmp_path, "--env", "none", overrides=["train.resume=auto"])
    train_line = next(line for line in script.splitlines() if "-m lmforge.cli train" in line)
    assert train_line.count("train.resume=") == 1 and "train.resume=auto" in train_line
    out = tmp_path / "refused.sbatch"
    code = main(["launch", "slurm", *LAYOUT, "train.resume=runs/x/checkpoints/step-0000010",
                 "--nodes", "1", "--gpus-per-node", "8", "--output", str(out)])
    assert code == 2 and not out.exists()
    assert "train.resume" in capsys.readouterr().err


def test_the_environment_is_the_launching_venv_an_env_option_or_none(tmp_path, capsys):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "activate").write_text("")
    script = write_script(tmp_path, "--env", str(venv), "--setup", "module load cuda/12.4")
    assert script.index("module load cuda/12.4") < script.index(
        f"source {venv}/bin/activate") < script.index("\nsrun ")
    in_venv = sys.prefix != sys.base_prefix
    assert (f"source {sys.prefix}/bin/activate" in write_script(tmp_path)) == in_venv
    assert "activate" not in write_script(tmp_path, "--env", "none")
    code = main(["launch", "slurm", *LAYOUT, "--nodes", "1", "--gpus-per-node", "8",
                 "--output", str(tmp_path / "x.sbatch"), "--env", str(tmp_path)])
    assert code == 2 and "--env" in capsys.readouterr().err


# Stand-ins: srun runs one "task" that exits 1 once it gets USR1 (as torchrun does after
# its workers checkpointed), or with FAKE_SRUN_STATUS right away; scontrol logs requeues.
FAKE_SRUN = """#!/bin/bash
trap 'echo "srun got USR1" >> "$LOG"; exit 1' USR1
touch "$LOG.started"
if [ -n "${FAKE_SRUN_STATUS:-}" ]; then exit "$FAKE_SRUN_STATUS"; fi
for _ in $(seq 600); do sleep 0.05; done  # 30 s at most, should the test fail
"""
FAKE_SCONTROL = """#!/bin/bash
if [ "$1" = show ]; then echo node001; else echo "scontrol $*" >> "$LOG"; fi
"""


def run_job(tmp_path, warn: bool, srun_status=None) -> tuple[int, str]:
    """The generated script under bash with the stand-ins; ``warn``: send it SIGUSR1 as
    SLURM's --signal=B:USR1 does. Returns its status and what the stand-ins logged."""
    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    script = tmp_path / "job.sbatch"
    script.write_text(render_slurm_script(None, LAYOUT, 1, 8))
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "LOG": str(log),
           "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node001"}
    if srun_status is not None:
        env["FAKE_SRUN_STATUS"] = str(srun_status)
    job = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.DEVNULL,
                           start_new_session=True)
    try:
        deadline = time.time() + 30
        while not (tmp_path / "log.started").exists():
            assert job.poll() is None and time.time() < deadline
            time.sleep(0.02)
        if warn:
            job.send_signal(signal.SIGUSR1)
        job.wait(timeout=30)
    finally:  # nothing of the job outlives the test, srun's stand-in included
        try:
            os.killpg(job.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # all of it has ended
    return job.returncode, log.read_text() if log.exists() else ""


def test_the_time_limit_warning_reaches_srun_and_the_job_requeues(tmp_path):
    status, log = run_job(tmp_path, warn=True)
    assert log.splitlines() == ["srun got USR1", "scontrol requeue 4242"]
    assert status == 1


@pytest.mark.parametrize("srun_status", [0, 3])
def test_without_a_warning_the_job_ends_with_the_run_and_is_not_requeued(tmp_path,
                                                                        srun_status):
    status, log = run_job(tmp_path, warn=False, srun_status=srun_status)
    assert status == srun_status and "requeue" not in log


def run_set_up(tmp_path, setup: tuple[str, ...], env=None) -> subprocess.CompletedProcess:
    """The generated script with these ``--setup`` lines (and ``env``), under bash with
    the stand-ins; srun's stand-in exits at once, leaving ``log.started``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    script = tmp_path / "job.sbatch"
    script.write_text(render_slurm_script(None, LAYOUT, 1, 8, env=env, setup=setup))
    environ = {k: v for k, v in os.environ.items() if k != "UNSET_BY_THE_TEST"}
    environ.update(PATH=f"{bin_dir}:{os.environ['PATH']}", LOG=str(tmp_path / "log"),
                   SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="node001", FAKE_SRUN_STATUS="0")
    return subprocess.run(["bash", str(script)], env=environ, capture_output=True, text=True,
                          timeout=30)


@pytest.mark.parametrize("failing", ["false", "false | cat", "module_that_is_not_there x"])
def test_a_failed_set_up_line_stops_the_job_before_it_trains(tmp_path, failing):
    """A failed `module load` or `conda activate` used to go on and train in the wrong
    environment: the set-up lines ran before `set -euo pipefail`."""
    done = tmp_path / "after"
    job = run_set_up(tmp_path, ("echo set-up starts", failing, f"touch {done}"))
    assert job.returncode != 0
    assert not (tmp_path / "log.started").exists()  # srun (the training) never ran
    assert not done.exists()  # nor the set-up line after the failed one
    assert job.stdout.splitlines() == ["set-up starts"]
    command = failing.split(" | ")[-1] if "|" in failing else failing
    assert f"lmforge: set-up failed (status {job.returncode}): {command}" in job.stderr


def test_a_failed_activation_stops_the_job_and_set_up_may_read_unset_variables(tmp_path):
    """Set-up runs without -u (activation and module scripts read variables that may be
    unset, as "$UNSET_BY_THE_TEST" here), the rest of the script with it."""
    job = run_set_up(tmp_path, ('echo "[${UNSET_BY_THE_TEST}]"',))
    assert job.returncode == 0 and (tmp_path / "log.started").exists(), job.stderr
    assert job.stdout.splitlines()[0] == "[]"
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "activate").write_text("return 3\n")  # an activation that fails
    (tmp_path / "log.started").unlink()
    job = run_set_up(tmp_path, (), env=str(venv))
    assert job.returncode == 3 and not (tmp_path / "log.started").exists()
    assert f"lmforge: set-up failed (status 3): source {venv}/bin/activate" in job.stderr
    script = render_slurm_script(None, LAYOUT, 1, 8, env=str(venv), setup=("module load x",))
    order = [script.index(text) for text in ("\nset -eo pipefail\n", "\neval ",
                                             "\nsource ", "\nset -u\n", "\nsrun ")]
    assert order == sorted(order)
