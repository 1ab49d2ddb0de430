"""Under torchrun, a run over its memory budget is refused like a layout error: every rank
refuses before any process group, rank 0 alone says why in one line, nothing is written."""
import re

import pytest

from helpers.runs import has_lmforge_frame, run_lmforge

pytestmark = pytest.mark.slow

# A full 70B training step on the CPU: about 1.3 TiB per process over 2 dp_shard ranks.
HUGE = ["model.preset=llama3-70b", "model.vocab_size=128256", "data.seq_len=4096",
        "train.device=cpu"]


def test_under_torchrun_a_run_over_its_memory_is_one_line_from_rank_0(tmp_path):
    proc = run_lmforge(tmp_path / "run", HUGE, nproc=2, check=False)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "lmforge: error:" in line]
    assert len(errors) == 1 and "error: memory: the run needs about" in errors[0], \
        proc.stderr[-3000:]
    assert "train.skip_memory_check=true" in errors[0]
    assert not has_lmforge_frame(proc.stderr), proc.stderr[-3000:]
    assert re.search(r"Root Cause.*?rank\s*: 0 .*?exitcode\s*: 2 ", proc.stderr, re.S)
    assert not (tmp_path / "run").exists()
