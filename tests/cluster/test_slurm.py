"""`lmforge launch slurm --submit` on a live one-host SLURM cluster (slurmctld, slurmd and
munged started by the test from the OS packages; `make test-cluster`), in the script's CPU
form (--gpus-per-node 0 --procs-per-node 2, gloo):

* a job trains, exports and ends COMPLETED;
* `scontrol requeue` mid-run: lmforge checkpoints on the signal, the job is requeued,
  resumes with train.resume=auto, and its final weights have the SHA-256 of the
  uninterrupted job's;
* a job whose --time is short (2 minutes) is warned (--signal=B:USR1@--stop-before), checkpoints and
  requeues itself before the limit kills it.

Skipped, saying why, where SLURM is not installed and cannot be (root and apt-get)."""
from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.runs import free_port, read_metrics, tiny_overrides
from helpers.slurm_cluster import SlurmCluster, ensure_installed

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
STEPS = 240


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    ensure_installed()
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    cluster.start()
    yield cluster
    cluster.stop()


def submit(slurm: SlurmCluster, workdir: Path, out: Path, overrides: list[str],
           *options: str) -> str:
    """``lmforge launch slurm ... --submit`` from ``workdir``; returns the job id."""
    workdir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "lmforge.cli", "launch", "slurm", *overrides,
           f"train.output_dir={out}", "--nodes", "1", "--gpus-per-node", "0",
           "--procs-per-node", "2", "--cpus-per-task", str(os.cpu_count()),
           "--port", str(free_port()), "--job-name", "lmforge-test", *options, "--submit"]
    proc = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True,
                          env={**slurm.env, "OMP_NUM_THREADS": "1"}, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return re.search(r"Submitted batch job (\d+)", proc.stdout).group(1)


def _ends_requeued(slurm: SlurmCluster, job: str, timeout: float = 240) -> bool:
    """Whether the job was requeued (True) or ended otherwise (False), whichever first."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        fields = slurm.job(job)
        if int(fields.get("Restarts", 0)) >= 1:
            return True
        if fields.get("JobState") in ("TIMEOUT", "FAILED", "COMPLETED", "CANCELLED"):
            return False
        time.sleep(1)
    return False


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def log_of(workdir: Path, job_id: str) -> str:
    return (workdir / "slurm-logs" / f"lmforge-test-{job_id}.out").read_text()


def wait_for_step(out: Path, step: int, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not (out / "metrics.jsonl").is_file() or \
            read_metrics(out)[-1:] == [] or read_metrics(out)[-1]["step"] < step:
        assert time.time() < deadline, f"{out}: no step {step} within {timeout} s"
        time.sleep(0.5)


def overrides(tiny_corpus, steps: int = STEPS) -> list[str]:
    return tiny_overrides(tiny_corpus, steps) + ["parallel.dp_shard=2",
                                                 "train.checkpoint_every=60"]


@pytest.fixture(scope="module")
def uninterrupted(slurm, tiny_corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("normal")
    job = submit(slurm, root, root / "run", overrides(tiny_corpus), "--time", "20")
    fields = slurm.wait_for(job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"))
    return job, fields, root


def test_a_submitted_job_trains_exports_and_completes(uninterrupted):
    job, fields, root = uninterrupted
    assert fields["JobState"] == "COMPLETED", (fields, log_of(root, job))
    assert [r["step"] for r in read_metrics(root / "run")] == list(range(1, STEPS + 1))
    assert (root / "run" / "hf" / "model.safetensors").is_file()
    print(f"normal job {job}: JobState={fields['JobState']} Restarts={fields['Restarts']} "
          f"ExitCode={fields['ExitCode']}")


def test_a_requeued_job_resumes_and_ends_with_the_uninterrupted_weights(
        slurm, tiny_corpus, tmp_path, uninterrupted):
    out = tmp_path / "run"
    job = submit(slurm, tmp_path, out, overrides(tiny_corpus), "--time", "20")
    wait_for_step(out, 80)
    slurm.run("scontrol", "requeue", job)
    requeued = slurm.wait_for(job, ("PENDING",), timeout=180, restarts=1)
    # (a requeued job waits on its BeginTime: start it now)
    slurm.run("scontrol", "update", f"JobId={job}", "StartTime=now")
    fields = slurm.wait_for(job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"))
    log = log_of(tmp_path, job)
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "1", (fields, log)
    # the signal's own checkpoint (not the last periodic one), then attempt 2 from it
    stopped = re.search(r"preempted at step (\d+): checkpoint written", log)
    assert stopped and int(stopped.group(1)) % 60, log[-3000:]
    assert "attempt 2" in log and f"(step {stopped.group(1)})" in log, log[-3000:]
    assert [r["step"] for r in read_metrics(out)] == list(range(1, STEPS + 1))
    reference = uninterrupted[2] / "run" / "hf" / "model.safetensors"
    assert sha256(out / "hf" / "model.safetensors") == sha256(reference)
    print(f"requeued job {job}: after requeue JobState={requeued['JobState']} "
          f"Reason={requeued['Reason']}; at the end JobState={fields['JobState']} "
          f"Restarts={fields['Restarts']} ExitCode={fields['ExitCode']}")


def test_a_job_near_its_time_limit_checkpoints_and_requeues_itself(slurm, tiny_corpus,
                                                                    tmp_path):
    out = tmp_path / "run"
    # 2 minutes, warned 60 s before: SLURM checks limits about every 30 s, so the warning
    # comes 30 to 90 s in, after start-up (a warning before torchrun has set its handlers
    # kills it: seen with 1 minute and 45 s on a busy machine) and long before these steps
    # end
    job = submit(slurm, tmp_path, out, overrides(tiny_corpus, 100_000), "--time", "2",
                 "--stop-before", "60")
    # (PENDING before it first runs too: wait for the requeue, or for how it ended)
    fields = slurm.wait_for(job, ("PENDING",), timeout=240, restarts=1) if _ends_requeued(
        slurm, job) else slurm.job(job)
    log = log_of(tmp_path, job)
    slurm.run("scancel", job)
    assert fields["JobState"] == "PENDING" and fields["Restarts"] == "1", (fields, log)
    assert "stopped before the time limit" in log and "requeueing" in log, log[-3000:]
    checkpoints = sorted((out / "checkpoints").glob("step-*"))
    stopped_at = read_metrics(out)[-1]["step"]
    assert checkpoints and checkpoints[-1].name == f"step-{stopped_at:07d}"
    print(f"time-limited job {job}: JobState={fields['JobState']} "
          f"Restarts={fields['Restarts']} Reason={fields.get('Reason')}; checkpoint "
          f"{checkpoints[-1].name}")
