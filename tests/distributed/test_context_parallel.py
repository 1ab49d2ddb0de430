"""Context parallelism (parallel.cp) through `lmforge train` under torchrun: a cp=2 run
checkpoints, and the checkpoint resumes in one plain process with the losses the cp=2 run
itself continues with (1e-5); the layouts it does not run with yet are refused before any
compute, in one line from rank 0. (Step-by-step equality with one process for every family,
causal, windowed and document-masked, under cp=2, cp=4, cp x dp_shard, cp x tp and LoRA:
tests/distributed/test_family_equivalence.py.)"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.runs import read_metrics, run_lmforge, tiny_overrides

pytestmark = pytest.mark.slow


@pytest.mark.long
def test_a_cp2_checkpoint_resumes_in_one_process_with_the_same_next_losses(tiny_corpus,
                                                                           tmp_path):
    base = tiny_overrides(tiny_corpus, 4) + ["data.document_mask=true", "data.kind=text"]
    saved = tmp_path / "saved"
    run_lmforge(saved, base + ["parallel.cp=2", "train.stop_at_step=2"], nproc=2)
    one, cp2 = tmp_path / "one", tmp_path / "cp2"
    shutil.copytree(saved, one)
    shutil.copytree(saved, cp2)
    run_lmforge(cp2, base + ["parallel.cp=2", "train.resume=auto"], nproc=2)
    run_lmforge(one, base + ["train.resume=auto"], nproc=1)
    a, b = read_metrics(cp2), read_metrics(one)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4]
    for x, y in zip(a[2:], b[2:]):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5)
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-4)
    assert a[0]["tokens"] == b[0]["tokens"]  # each position counted once, not per cp rank


@pytest.mark.parametrize("extra,message", [
    (["parallel.pp=2"], "parallel.cp: not combined with parallel.pp yet"),
    (["model.attention=flex"], "model.attention")])
def test_what_cp_does_not_run_with_is_refused_in_one_line(tiny_corpus, tmp_path, extra,
                                                          message):
    proc = run_lmforge(tmp_path / "r", tiny_overrides(tiny_corpus, 2) + ["parallel.cp=2"]
                       + extra, nproc=2, check=False)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "lmforge: error" in line]
    assert len(errors) == 1 and message in errors[0], proc.stderr[-2000:]


# Measured like bench/plan_check.py (the demo's tiny model, 2 or 4 gloo processes): the
# estimate's peak allocated bytes against the trainer's second step's tensor peak, max over
# ranks (bench/tensor_peak_worker.py). Long sequences, so that the gathered k/v and the
# masks are a large share: the 1024-token rows' cp=2 masks are 2 MiB a layer as the CPU's
# kernel keeps them (fp32).
ESTIMATE_TOLERANCE = 0.15  # the estimate's CPU tolerance (docs/estimate.md)
CP_LAYOUTS = {
    "cp2 mb2 seq512": (2, ["data.seq_len=512", "data.micro_batch_size=2"]),
    "cp2 documents mb2 seq1024": (2, ["data.seq_len=1024", "data.micro_batch_size=2",
                                      "data.document_mask=true"]),
    "cp2 documents full mb4 seq1024": (2, ["data.seq_len=1024", "data.micro_batch_size=4",
                                           "data.document_mask=true",
                                           "train.activation_checkpointing=full"]),
    "cp2 x tp2 documents mb2 seq1024": (4, ["parallel.tp=2", "data.seq_len=1024",
                                            "data.micro_batch_size=2",
                                            "data.document_mask=true"]),
}
PEAK_BASE = ["data.global_batch_size=8", "data.eval_fraction=0", "parallel.cp=2",
             "parallel.dp_shard=1", "model.tie_embeddings=false"]


@pytest.mark.long  # (a minute in all: make test-long)
@pytest.mark.parametrize("layout", sorted(CP_LAYOUTS))
def test_the_estimate_of_a_cp_layout_is_within_tolerance_of_its_measured_peak(layout,
                                                                             tmp_path):
    from lmforge.cli.common import config_and_overrides
    from lmforge.config import load_config
    from lmforge.perf.estimate import estimate_memory
    from lmforge.perf.estimate_setup import setup_from_config

    nproc, keys = CP_LAYOUTS[layout]
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LMFORGE_TENSOR_PEAK_DIR": str(tmp_path),
           "PYTHONPATH": str(root / "src")}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc-per-node={nproc}", str(root / "bench" / "tensor_peak_worker.py"),
                    *PEAK_BASE, *keys, "train.max_steps=2", "train.save=false",
                    f"train.output_dir={tmp_path / 'run'}"],
                   check=True, capture_output=True, env=env, timeout=600)
    measured = max(json.loads(p.read_text())["step_peak_bytes"]
                   for p in tmp_path.glob("rank*.json"))
    cfg = load_config(*config_and_overrides(None, PEAK_BASE + keys))
    estimated = estimate_memory(setup_from_config(cfg, device="cpu",
                                                  world_size=nproc)).peak_bytes
    assert estimated == pytest.approx(measured, rel=ESTIMATE_TOLERANCE), \
        f"{layout}: estimated {estimated / 2**20:.1f} MiB, measured {measured / 2**20:.1f}"


def test_the_memory_check_holds_a_cp_run_to_its_per_rank_estimate():
    from lmforge.config import load_config
    from lmforge.job import resolve
    from lmforge.perf.budget import check_memory
    from lmforge.perf.estimate import estimate_memory
    from lmforge.perf.estimate_setup import Setup

    def job(cp):
        return resolve(load_config(None, [f"parallel.cp={cp}", "parallel.dp_shard=1",
                                          "data.seq_len=1024", "train.device=cpu"]),
                       cp, tokenizer_vocab=None)

    check = check_memory(job(2))
    assert check.budget is not None and not check.unchecked
    # half of each sequence per rank: less than one process holding all of it
    one, two = (estimate_memory(Setup(job(n))) for n in (1, 2))
    assert two.peak_bytes < one.peak_bytes


def test_each_parameters_first_gradient_under_cp2_equals_one_process(tmp_path):
    """Before any update: every family's every gradient over packed documents, to 1e-6
    (test_family_equivalence then compares four steps of Adam, which amplify rounding)."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(root / "src"), str(root / "tests"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node=2", str(root / "tests" / "helpers" /
                                                     "cp_gradients.py"), str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    worst = json.loads((tmp_path / "cp-gradients.json").read_text())
    assert set(worst) == {"mistral", "qwen2", "qwen3", "gptj", "phi3", "gemma3"}
    assert all(diff < 1e-6 for diff in worst.values()), worst
