"""Every LoRA mode resumes exactly: pretraining text and SFT, LoRA and QLoRA, adapters
alone and with the norms and biases training beside them (a second, no-decay parameter
group), in one process (also with the low-memory optimizer: bf16 moments, stochastic
rounding, the step fused into backward), under FSDP2 (dp_shard=2; also with bf16
moments) and pipelined (pp=2). Each case stopped after step 2 and resumed logs the
uninterrupted run's losses and gradient norms and ends with its weights, bit for bit
(deterministic fp32 on the CPU, as test_resume demands of full-weight runs).

Not in the matrix because refused before any step: QLoRA with more than one process or
FSDP2, and LoRA under tensor parallelism (lmforge.config.schema.validate).

The cases run through the trainer in two launches (tests/helpers/resume_modes.py): one
process, then torchrun with two. About 50 s + 70 s on a 2-core CPU."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import resume_modes as rm
from helpers.runs import read_metrics
from lmforge.checkpoint import read_model_state
from lmforge.checkpoint.safe_load import read_metadata_file

pytestmark = [pytest.mark.slow, pytest.mark.long]  # make test-long: kept out of make test's 15 minutes
TESTS = Path(__file__).resolve().parents[1]
SRC = TESTS.parent / "src"


def _launch(corpus: Path, out: Path, nproc: int) -> dict:
    """The cases of ``nproc`` processes, run; returns case -> traceback of those that
    raised."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(SRC), str(TESTS), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    launcher = ([] if nproc == 1 else
                ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"])
    proc = subprocess.run([sys.executable, *launcher, rm.__file__, str(corpus), str(out)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return json.loads((out / f"errors-{nproc}.json").read_text())


@pytest.fixture(scope="module")
def launches(tiny_corpus, tmp_path_factory):
    """Process count -> (errors, the folder of the cases' runs)."""
    out = tmp_path_factory.mktemp("lora-resume")
    rm.write_sft_pairs(tiny_corpus, out)
    return {nproc: (_launch(tiny_corpus, out, nproc), out)
            for nproc in sorted({nproc for nproc, _ in rm.CASES.values()})}


def _trained(checkpoint: Path) -> set[str]:
    """The parameters a checkpoint holds optimizer state for."""
    keys = read_metadata_file(checkpoint / ".metadata").state_dict_metadata
    return {k[len("optimizer.state."):].rsplit(".", 1)[0] for k in keys
            if k.startswith("optimizer.state.")}


@pytest.mark.parametrize("case", list(rm.CASES))
def test_lora_mode_stopped_and_resumed_equals_the_uninterrupted_run(launches, case):
    errors, out = launches[rm.CASES[case][0]]
    assert case not in errors, f"{case} failed:\n{errors[case]}"
    straight, split = out / case / "straight", out / case / "split"
    want, got = read_metrics(straight), read_metrics(split)
    assert [r["step"] for r in got] == list(range(1, rm.STEPS + 1))
    assert [(r["loss"], r["grad_norm"]) for r in got] == [(r["loss"], r["grad_norm"])
                                                          for r in want]
    final = f"checkpoints/step-{rm.STEPS:07d}"
    weights, resumed = read_model_state(straight / final), read_model_state(split / final)
    assert weights.keys() == resumed.keys()
    for key in weights:
        assert torch.equal(weights[key], resumed[key]), key
    trained = _trained(split / final)
    vectors = {"layers.0.attention_norm.weight", "layers.0.attention.q_proj.bias", "norm.weight"}
    if "+norms" in case:
        assert vectors <= trained, sorted(vectors - trained)
    else:
        assert trained and all(k.endswith((".lora_a", ".lora_b")) for k in trained)
