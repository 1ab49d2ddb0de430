"""Every parallel layout trains exactly like one process: same per-step losses (1e-5
relative) and final weights (1e-4), on CPU with gloo. A tiny Llama with a vocabulary
(301) that tp=2 does not divide, fp32, same seed, data and global batch."""
import os
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from helpers.runs import has_lmforge_frame, read_metrics, run_lmforge, tiny_overrides

pytestmark = pytest.mark.slow
STEPS = 5


@pytest.fixture(scope="module")
def setup(tiny_corpus, tmp_path_factory):
    base = tiny_overrides(tiny_corpus, STEPS)
    reference = _train(tmp_path_factory.mktemp("single"), base, nproc=1)[:2]
    return tmp_path_factory.mktemp("layouts"), base, reference


def _train(out, overrides, nproc, torchrun=False):
    proc = run_lmforge(out, overrides, nproc, torchrun=torchrun)
    # The gradient norm is compared too: Adam and clipping hide a uniform gradient scale.
    losses = [(r["loss"], r["grad_norm"]) for r in read_metrics(out)]
    return losses, load_file(out / "hf" / "model.safetensors"), proc.stdout


LAYOUTS = {
    # one process under torchrun: a one-device mesh, FSDP2 (the distributed path alone)
    "fsdp_one_process": (1, ["parallel.dp_shard=1"]),
    "fsdp_zero3_dp2": (2, ["parallel.dp_shard=2", "parallel.zero=3"]),
    "fsdp_zero2_dp2": (2, ["parallel.dp_shard=2", "parallel.zero=2"]),
    # the output layer applied 24 tokens at a time, outside the root module's forward
    "fsdp_zero3_dp2_chunked_loss": (2, ["parallel.dp_shard=2", "train.loss_chunk_tokens=24"]),
    "ddp_dp2": (2, ["parallel.dp_replicate=2", "parallel.dp_shard=1"]),
    "hsdp_2x2": (4, ["parallel.dp_replicate=2", "parallel.dp_shard=2"]),
    "tp2_sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "tp2_no_sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=false"]),
    "pp2_gpipe": (2, ["parallel.pp=2", "parallel.pp_schedule=gpipe"]),
    "pp2_1f1b": (2, ["parallel.pp=2", "parallel.pp_schedule=1f1b"]),
    "pp2_interleaved": (2, ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b",
                            "parallel.pp_virtual_stages=2"]),
    "dp2_tp2": (4, ["parallel.dp_shard=2", "parallel.tp=2"]),
    "pp2_dp2": (4, ["parallel.pp=2", "parallel.dp_shard=2"]),
}


# make test-long: variants of a layout make test keeps one of (zero-2 beside zero-3, tp
# without sp beside tp with sp, GPipe and interleaved beside 1F1B, the 4-process meshes
# beside pp x dp), kept out of make test's 15 minutes
LONG_LAYOUTS = ("fsdp_zero2_dp2", "tp2_no_sp", "pp2_gpipe", "pp2_interleaved", "hsdp_2x2",
                "dp2_tp2")


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.long] if n in LONG_LAYOUTS
                                               else []) for n in LAYOUTS])
def test_layout_matches_single_process(setup, name):
    root, base, (ref_losses, ref_weights) = setup
    nproc, layout = LAYOUTS[name]
    losses, weights, stdout = _train(root / name, base + layout, nproc, torchrun=True)
    assert ("FSDP2" in stdout) == ("dp_shard" in " ".join(layout)), stdout[:2000]
    assert len(losses) == len(ref_losses) == STEPS
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(losses, ref_losses), 1):
        assert loss == pytest.approx(ref_loss, rel=1e-5), f"step {step}: loss {loss} vs {ref_loss}"
        assert norm == pytest.approx(ref_norm, rel=1e-4), f"step {step}: grad norm {norm} vs {ref_norm}"
    assert weights.keys() == ref_weights.keys()
    for key in ref_weights:
        torch.testing.assert_close(weights[key], ref_weights[key], rtol=1e-4, atol=1e-4,
                                   msg=lambda m: f"{key}: {m}")


# A tied model (the head's weight is the embedding's), 4 sequences a step: one micro-batch
# of 4 per pipeline run, which the pipeline splits into pp=2 microbatches by default.
TIED = ["model.tie_embeddings=true", "data.global_batch_size=4", "train.checkpoint_every=2"]
PIPELINE_ONE_MICRO_BATCH = ["parallel.pp=2", "parallel.dp_shard=1", "data.micro_batch_size=4"]
TIED_STEPS = 4


@pytest.fixture(scope="module")
def tied_reference(tiny_corpus, tmp_path_factory):
    base = tiny_overrides(tiny_corpus, TIED_STEPS) + TIED
    return base, _train(tmp_path_factory.mktemp("tied_single"), base, nproc=1)[:2]


def _assert_same_run(losses, weights, reference):
    ref_losses, ref_weights = reference
    assert len(losses) == len(ref_losses) == TIED_STEPS
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(losses, ref_losses), 1):
        assert loss == pytest.approx(ref_loss, rel=1e-5), f"step {step}: loss {loss} vs {ref_loss}"
        assert norm == pytest.approx(ref_norm, rel=1e-4), f"step {step}: grad norm {norm} vs {ref_norm}"
    assert weights.keys() == ref_weights.keys() and "lm_head.weight" not in weights
    for key in ref_weights:
        torch.testing.assert_close(weights[key], ref_weights[key], rtol=1e-4, atol=1e-4,
                                   msg=lambda m: f"{key}: {m}")


def test_tied_model_pipelined_1f1b_matches_single_process(tied_reference, tmp_path):
    base, reference = tied_reference
    losses, weights, _ = _train(tmp_path, base + PIPELINE_ONE_MICRO_BATCH, nproc=2)
    _assert_same_run(losses, weights, reference)


@pytest.mark.long  # (make test-long: 15 s)
def test_tied_model_interleaved_with_tp_matches_and_resumes_in_one_process(
        tied_reference, tmp_path):
    """Steps 1-2 interleaved over pp=2 ranks x 2 stages, each stage over tp=2 (the
    embedding's gradient is replicated, the head's vocab-sharded), checkpointed: the
    weight both end stages hold is saved once. Steps 3-4 resume it in one plain process."""
    base, reference = tied_reference
    interleaved = ["parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual_stages=2",
                   "parallel.tp=2"]
    run_lmforge(tmp_path, base + PIPELINE_ONE_MICRO_BATCH + interleaved +
                ["train.stop_at_step=2"], nproc=4)
    losses, weights, _ = _train(tmp_path, base + ["train.resume=auto"], nproc=1)
    _assert_same_run(losses, weights, reference)


def test_layout_that_does_not_fit_is_refused_before_any_process_group(tmp_path, setup):
    root, base, _ = setup
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": "0", "WORLD_SIZE": "3",
           "LOCAL_RANK": "0"}
    env.pop("MASTER_ADDR", None)  # any process-group work would fail on this
    proc = subprocess.run(
        [sys.executable, "-m", "lmforge.cli", "train", *base, "parallel.tp=3",
         f"train.output_dir={tmp_path}/run"], capture_output=True, text=True, env=env,
        timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("lmforge: error: parallel.tp:")
    assert "\n" not in proc.stderr.strip()


def test_under_torchrun_a_layout_error_is_one_line_from_rank_0_without_traceback(tmp_path):
    """Both ranks refuse the demo's pipeline split (1 sequence per step, 2 stages); rank
    0 says why and exits 2 first, so torchrun names it as the root cause."""
    proc = run_lmforge(tmp_path / "run", ["parallel.pp=2", "parallel.dp_shard=1",
                                          "data.micro_batch_size=1"], nproc=2, check=False)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "lmforge: error:" in line]
    assert len(errors) == 1 and "error: data.micro_batch_size:" in errors[0], proc.stderr[-3000:]
    assert not has_lmforge_frame(proc.stderr), proc.stderr[-3000:]
    assert re.search(r"Root Cause.*?rank\s*: 0 .*?exitcode\s*: 2 ", proc.stderr, re.S)


def test_lora_under_fsdp_matches_single_process(tiny_corpus, tmp_path):
    base = tiny_overrides(tiny_corpus, STEPS) + ["lora.enabled=true", "lora.targets=all-linear",
                                                 "lora.rank=4"]
    ref_losses, ref_weights, _ = _train(tmp_path / "single", base, nproc=1)
    losses, weights, _ = _train(tmp_path / "fsdp", base + ["parallel.dp_shard=2"], nproc=2)
    for (loss, norm), (ref_loss, ref_norm) in zip(losses, ref_losses):
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        assert norm == pytest.approx(ref_norm, rel=1e-4)
    adapters = [load_file(tmp_path / d / "adapter" / "adapter_model.safetensors")
                for d in ("single", "fsdp")]
    assert adapters[0].keys() == adapters[1].keys() and adapters[0]
    for key in adapters[0]:
        torch.testing.assert_close(adapters[1][key], adapters[0][key], rtol=1e-4, atol=1e-4)
