"""The time-limit warning through torchrun, started as the SLURM script starts it:
SIGUSR1 sent to torchrun reaches the workers, and every rank stops after the same step
with one committed checkpoint, also a rank that ignored the signal (the decision is
collective)."""
import signal

import pytest

from helpers.runs import await_pid, read_metrics, run_lmforge, tiny_overrides
from lmforge.checkpoint import is_complete
from lmforge.launch import TORCHRUN_SIGNALS

pytestmark = pytest.mark.slow


def test_sigusr1_to_torchrun_stops_every_rank_at_one_step_with_a_checkpoint(tiny_corpus,
                                                                            tmp_path):
    base = tiny_overrides(tiny_corpus, 6) + ["parallel.dp_shard=2", "train.save=false"]
    out, ready = tmp_path / "run", tmp_path / "at-step-3"
    # Rank 1 waits after step 3 for the signal; rank 0 ignores SIGUSR1 (await_stop).
    proc = run_lmforge(out, base, nproc=2, fault="await_stop:3", background=True,
                       torchrun_args=[f"--signals-to-handle={TORCHRUN_SIGNALS}"],
                       env={"LMFORGE_TEST_SIGNAL": str(ready)})
    await_pid(ready, proc)
    proc.send_signal(signal.SIGUSR1)  # to torchrun, as srun passes it on
    stdout, stderr = proc.communicate(timeout=300)
    assert "preempted at step 3: checkpoint written" in stdout, stderr[-3000:]
    # The workers left by themselves, within torchrun's shutdown timeout (torchrun then
    # exits 1 whatever their status).
    assert "forcefully exiting" not in stderr and proc.returncode != 0
    checkpoints = sorted((out / "checkpoints").iterdir())
    assert [p.name for p in checkpoints] == ["step-0000003"] and is_complete(checkpoints[0])
    assert sorted(p.name for p in checkpoints[0].glob("*.distcp")) == ["__0_0.distcp",
                                                                       "__1_0.distcp"]
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]
