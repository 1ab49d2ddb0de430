"""bench/generate.py and bench/decode_matmuls.py run on tiny shapes on the CPU: both
sides decode, their tokens agree, the tables print (no timing is asserted)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.long  # (20-30 s: transformers and lmforge each load and decode twice)
def test_the_decoding_bench_runs_both_sides_and_they_agree(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(BENCH / "generate.py"), "--layers", "2",
                           "--dim", "64", "--heads", "4", "--kv-heads", "2", "--ffn", "128",
                           "--vocab", "300", "--new-tokens", "6", "--prompt-len", "5",
                           "--batches", "1,3", "--threads", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 3]
    assert all(r["same_tokens"] and r["lmforge"]["tokens_per_s"] > 0 for r in rows)


def test_the_matmul_floor_bench_prints_its_three_columns():
    proc = subprocess.run([sys.executable, str(BENCH / "decode_matmuls.py"), "--layers", "1",
                           "--rows", "1,2", "--threads", "1"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [l for l in proc.stdout.splitlines() if l.startswith("| 1 |") or l.startswith("| 2 |")]
    assert len(lines) == 2 and all(len(l.split("|")) == 6 for l in lines)


@pytest.mark.long  # (20-30 s, as above)
def test_the_decoding_bench_takes_an_moe_preset_and_transformers_grouped_mm_agrees(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(BENCH / "generate.py"), "--preset",
                           "qwen3-moe-debug", "--dim", "64", "--layers", "2", "--experts", "8",
                           "--top-k", "2", "--moe-ffn", "64", "--new-tokens", "6",
                           "--prompt-len", "5", "--batches", "1,3", "--threads", "1",
                           "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "experts_implementation=grouped_mm" in proc.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 3]
    assert all(r["tokens_differing"] == 0 and r["lmforge"]["tokens_per_s"] > 0 for r in rows)
