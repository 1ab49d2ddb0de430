"""The batched decoder on a model sharded for training: FSDP2 over 2 processes and tensor
parallelism over 2 (gloo), with and without sequence parallelism, decode the tokens,
greedy and sampled, of one process: a tiny Llama, and a tiny hybrid Qwen3.5 (its Gated
DeltaNet states split by heads)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def decode_sharded(tmp_path, model: str) -> dict:
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(root / "src"), str(root / "tests"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node=2", str(root / "tests" / "helpers" /
                                                     "decode_sharded.py"), str(tmp_path),
                           model], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return json.loads((tmp_path / f"decode-sharded-{model}.json").read_text())


def check(result: dict) -> None:
    for layout in ("fsdp2", "tp2", "tp2_sp"):
        assert result[layout]["same_tokens"], result
        assert result[layout]["max_logprob_diff"] < 1e-5, result


def test_fsdp2_and_tp2_decode_what_one_process_decodes(tmp_path):
    check(decode_sharded(tmp_path, "llama"))


@pytest.mark.long  # (make test-long: 15 s)
def test_hybrid_decodes_under_fsdp2_and_tp2_what_one_process_decodes(tmp_path):
    """Qwen3.5's Gated DeltaNet states split by heads under tp; under sequence
    parallelism a one-token step's fillers stay out of them."""
    check(decode_sharded(tmp_path, "qwen3_5"))
