"""bench/attention_memory.py on the CPU: one attention call over a packed row of 16
documents needs less memory with FlexAttention's block mask than with SDPA's dense mask
(the figure in docs/benchmarks.md is this command at seq 8192)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.long  # (30 s: make test-long)
def test_flex_needs_less_memory_than_the_dense_mask_for_a_packed_row(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "bench" / "attention_memory.py"), "--seq",
                    "4096", "--json", str(tmp_path / "r.json")], check=True, timeout=600,
                   capture_output=True)
    rows = {r["kind"]: r for r in json.loads((tmp_path / "r.json").read_text())["rows"]}
    assert rows["flex"]["above_inputs_mib"] < rows["sdpa"]["above_inputs_mib"] / 2
    assert rows["flex"]["out_norm"] == pytest.approx(rows["sdpa"]["out_norm"], rel=1e-5)
