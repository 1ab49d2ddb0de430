"""The batched decoder on a model sharded for training: FSDP2 over 2 processes and tensor
parallelism over 2 (gloo) decode the tokens, greedy and sampled, of one process."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_fsdp2_and_tp2_decode_what_one_process_decodes(tmp_path):
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(root / "src"), str(root / "tests"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node=2", str(root / "tests" / "helpers" /
                                                     "decode_sharded.py"), str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    result = json.loads((tmp_path / "decode-sharded.json").read_text())
    for layout in ("fsdp2", "tp2"):
        assert result[layout]["same_tokens"], result
        assert result[layout]["max_logprob_diff"] < 1e-5, result
