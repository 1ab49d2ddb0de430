"""bench/hybrid_bench.py runs on its tiny shape on the CPU: every section's rows, both
sides' greedy tokens equal, both first-step losses equal (no timing is asserted)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "hybrid_bench.py"


@pytest.mark.long  # (7-20 s on 2 cores: transformers loads, trains and decodes beside lmforge)
def test_the_hybrid_bench_measures_both_sides_and_they_agree(tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--rounds", "1",
                           "--threads", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    sections = [r["section"] for r in rows]
    assert sections.count("train step") == 1 and sections.count("decoding") == 2
    assert sections.count("decode step") == 9  # 3 parts x (2 contexts + their growth)
    train = rows[0]["first_loss"]
    assert train["lmforge"] == pytest.approx(train["transformers"], rel=1e-4)
    assert all(r["same_tokens"] for r in rows if r["section"] == "decoding")
    assert all(r["lmforge"] > 0 and r["transformers"] > 0 for r in rows)
    assert "| train step |" in proc.stdout and "transformers" in proc.stdout.splitlines()[0]
