"""Where real jobs fail first, on one host: two torchrun agents (``--nnodes 2``, a c10d
rendezvous on localhost, 2 processes each, as the SLURM script starts one per node) form
one job that trains like one process, for HSDP (replicas across the two "nodes", shards
within) and HSDP x tp; and a rank killed with SIGKILL mid-run, or while it writes an
asynchronous checkpoint, ends the attempt without a hang, torchrun restarts the group
(``--max-restarts``), and the run resumes from the last complete checkpoint with the
losses of an uninterrupted run."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file

from helpers.runs import free_port, read_metrics, run_lmforge, tiny_overrides

pytestmark = [pytest.mark.slow, pytest.mark.long]  # (minutes: make test-long)
STEPS = 6
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "helpers", "patched_worker.py")



def _steps(out) -> list[tuple[float, float]]:
    return [(r["loss"], r["grad_norm"]) for r in read_metrics(out)]


@pytest.fixture(scope="module")
def one_process(tiny_corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    run_lmforge(out, tiny_overrides(tiny_corpus, STEPS))
    return _steps(out), load_file(out / "hf" / "model.safetensors")


def two_agents(out, overrides, timeout=600):
    """Two torchrun agents of 2 processes each meeting at one c10d rendezvous on
    localhost (the SLURM script's settings): returns both agents' outputs."""
    port, env = free_port(), {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
           f"--rdzv-id=lmforge-{port}", "-m", "lmforge.cli", "train", *overrides,
           f"train.output_dir={out}"]
    agents = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True) for _ in range(2)]
    outputs = [a.communicate(timeout=timeout) for a in agents]
    for agent, (stdout, stderr) in zip(agents, outputs):
        assert agent.returncode == 0, (stdout + stderr)[-4000:]
    return outputs


@pytest.mark.parametrize("layout", [["parallel.dp_replicate=2", "parallel.dp_shard=2"],
                                    ["parallel.dp_replicate=2", "parallel.dp_shard=1",
                                     "parallel.tp=2"]], ids=["hsdp_2x2", "hsdp2_x_tp2"])
def test_two_agents_form_one_job_that_trains_like_one_process(tiny_corpus, tmp_path,
                                                              one_process, layout):
    out = tmp_path / "run"
    outputs = two_agents(out, tiny_overrides(tiny_corpus, STEPS) + layout)
    said = "".join(stdout for stdout, _ in outputs)
    assert "on 4 x cpu" in said  # one job of 4 ranks, not two of 2
    ref_steps, ref_weights = one_process
    steps = _steps(out)
    assert len(steps) == len(ref_steps) == STEPS
    for (loss, norm), (ref_loss, ref_norm) in zip(steps, ref_steps):
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        assert norm == pytest.approx(ref_norm, rel=1e-5)
    weights = load_file(out / "hf" / "model.safetensors")
    for name, ref in ref_weights.items():
        assert (weights[name] - ref).abs().max() <= 1e-4 * ref.abs().max(), name


def restarted_run(tiny_corpus, out, fault, extra=()):
    """2 processes under torchrun with one restart allowed, ``fault`` injected into the
    first attempt; returns (the process, seconds it took)."""
    overrides = tiny_overrides(tiny_corpus, STEPS) + [
        "parallel.dp_shard=2", "train.checkpoint_every=2", "train.resume=auto",
        "parallel.timeout_s=60", *extra]
    start = time.time()
    proc = run_lmforge(out, overrides, nproc=2, fault=fault, timeout=900,
                       torchrun_args=["--max-restarts=1"])
    return proc, time.time() - start


@pytest.mark.parametrize("fault,extra", [
    ("die:1:5", []),  # after step 5's update: the checkpoint of step 4 is the last
    ("die_saving:1:4", ["train.async_checkpoint=true"]),  # step 4's is never complete
], ids=["killed_mid_run", "killed_while_saving_async"])
def test_a_killed_rank_restarts_the_group_which_resumes_with_the_same_losses(
        tiny_corpus, tmp_path, fault, extra, one_process):
    out = tmp_path / "run"
    proc, seconds = restarted_run(tiny_corpus, out, fault, extra)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, said[-4000:]
    assert "killing itself (SIGKILL)" in said
    # the survivor: one line naming what failed; torchrun's report: the lost rank
    lines = [l for l in proc.stderr.splitlines() if "lmforge: error: rank 0: a collective"
             in l]
    assert len(lines) == 1 and "another rank died" in lines[0], said[-4000:]
    assert re.search(r"failed \(exitcode: -9\) local_rank: 1 ", said), said[-4000:]
    resumed_from = 2 if fault.startswith("die_saving") else 4
    assert f"(step {resumed_from})" in said, said[-4000:]  # "resumed from ... (step N)"
    ref_steps, ref_weights = one_process
    steps = _steps(out)
    assert len(steps) == STEPS  # each step once in metrics.jsonl
    for (loss, norm), (ref_loss, ref_norm) in zip(steps, ref_steps):
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        assert norm == pytest.approx(ref_norm, rel=1e-5)
    assert seconds < 600  # no hang: the group ended and restarted by itself
