"""SLURM launch script, rank discovery from torchrun or SLURM, and the TP plan."""
import subprocess

import pytest

from lmforge.cli import main
from lmforge.parallel.mesh import expand_first_slurm_host, read_dist_env
from lmforge.models.llama.plan import block_plan, model_plan


def test_rank_comes_from_torchrun_or_slurm_alike():
    assert read_dist_env({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}).__dict__ == {
        "rank": 5, "world_size": 8, "local_rank": 1, "torchrun": True}
    slurm = {"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1"}
    assert read_dist_env(slurm).__dict__ == {"rank": 9, "world_size": 16, "local_rank": 1,
                                             "torchrun": False}
    # torchrun inside an srun allocation wins: its RANK is the worker's, not the node's.
    both = {**slurm, "RANK": "3", "WORLD_SIZE": "32", "LOCAL_RANK": "3"}
    assert read_dist_env(both).rank == 3
    assert read_dist_env({}).world_size == 1


def test_one_process_is_distributed_only_under_torchrun_with_dp_shard_1():
    from lmforge.config import ParallelConfig
    from lmforge.parallel.mesh import runs_distributed

    assert runs_distributed(ParallelConfig(dp_shard=1), 1, torchrun=True)
    assert not runs_distributed(ParallelConfig(), 1, torchrun=True)  # dp_shard=-1: plain
    assert not runs_distributed(ParallelConfig(dp_shard=1), 1, torchrun=False)
    assert runs_distributed(ParallelConfig(), 2, torchrun=False)


@pytest.mark.parametrize("nodelist, first", [
    ("gpu001", "gpu001"), ("gpu[003-005,007]", "gpu003"), ("a1,b2", "a1"),
    ("node[12,14]", "node12")])
def test_the_rendezvous_host_is_the_first_host_of_a_slurm_nodelist(nodelist, first):
    assert expand_first_slurm_host(nodelist) == first


def test_slurm_script_runs_one_torchrun_per_node_over_4_nodes_x_8_gpus(tmp_path, capsys):
    out = tmp_path / "job.sbatch"
    code = main(["launch", "slurm", "model.preset=llama2-7b", "parallel.tp=8",
                 "data.seq_len=4096", "--nodes", "4", "--gpus-per-node", "8",
                 "--partition", "gpu", "--output", str(out)])
    assert code == 0
    script = out.read_text()
    assert "#SBATCH --nodes=4" in script and "#SBATCH --gpus-per-node=8" in script
    assert "#SBATCH --ntasks-per-node=1" in script and "#SBATCH --partition=gpu" in script
    srun = [line for line in script.splitlines() if line.startswith("srun")]
    assert srun and "--kill-on-bad-exit=1" in srun[0]
    assert "torchrun --nnodes=4 --nproc-per-node=8" in script
    assert "--rdzv-backend=c10d --rdzv-endpoint=$head_node:29500" in script
    assert "--rdzv-id=$SLURM_JOB_ID" in script
    assert 'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in script
    assert "export MASTER_ADDR=$head_node" in script
    assert "-m lmforge.cli train model.preset=llama2-7b parallel.tp=8 data.seq_len=4096" in script
    # The script is valid bash.
    assert subprocess.run(["bash", "-n", str(out)]).returncode == 0


def test_slurm_launch_refuses_a_layout_that_does_not_fit(tmp_path, capsys):
    out = tmp_path / "job.sbatch"
    code = main(["launch", "slurm", "model.preset=llama2-7b", "parallel.tp=3",
                 "data.seq_len=4096", "--nodes", "1", "--gpus-per-node", "3",
                 "--output", str(out)])
    assert code == 2 and not out.exists()
    assert "parallel.tp" in capsys.readouterr().err


def test_tp_plan_is_a_readable_constant():
    plan = block_plan(sequence_parallel=True)
    assert type(plan["attention.q_proj"]).__name__ == "ColwiseParallel"
    assert type(plan["attention.o_proj"]).__name__ == "RowwiseParallel"
    assert type(plan["feed_forward.down_proj"]).__name__ == "RowwiseParallel"
    assert type(plan["attention_norm"]).__name__ == "SequenceParallel"
    assert "attention_norm" not in block_plan(sequence_parallel=False)
    assert type(model_plan(True)["output"]).__name__ == "ColwiseParallel"
