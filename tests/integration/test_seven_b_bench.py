"""bench/seven_b.py (issue 40's 7B rows) on the CPU with the debug preset: every row runs
both sides and writes its JSON line, so the prepared GPU command cannot rot; a reference
that needs bitsandbytes where it is missing is a skipped side saying so."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROWS = ["qlora", "int8-b1", "int8-b4", "int8-b7", "full-low-memory"]


@pytest.mark.long  # (50 s: every row's both sides on the debug preset)
def test_seven_b_writes_one_line_per_row_with_both_sides(tmp_path):
    out = tmp_path / "rows.jsonl"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "seven_b.py"), "--tiny",
                           "--device", "cpu", "--out", str(out)],
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["row"] for r in rows] == ROWS
    has_bnb = importlib.util.find_spec("bitsandbytes") is not None
    for r in rows:
        assert "error" not in r and r["lmforge"]["tokens_per_s"] > 0, r
        assert r["lmforge"]["peak_mem_gib"] > 0 and "peak" in r["met"], r
        ref = r["reference"]
        if r["row"] != "full-low-memory" and not has_bnb:
            assert "needs bitsandbytes" in ref["skipped"], r
        else:
            assert ref["tokens_per_s"] > 0 and r["speed_ratio"] > 0, r
    by_row = {r["row"]: r for r in rows}
    assert "--method lora-int8 --lora-rank 8 --lora-targets q_proj,v_proj" in \
        by_row["int8-b4"]["argv"] and "--batch 4" in by_row["int8-b4"]["argv"]
    assert by_row["int8-b7"]["targets"] == {"peak_below_gib": 39.31}


def test_seven_b_starts_no_row_past_its_budget(tmp_path):
    out = tmp_path / "rows.jsonl"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "seven_b.py"), "--tiny",
                           "--device", "cpu", "--budget-s", "-1", "--rows", "qlora",
                           "int8-b1", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [json.loads(line) for line in out.read_text().splitlines()] == [
        {"row": "qlora", "skipped": "time budget (--budget-s)"},
        {"row": "int8-b1", "skipped": "time budget (--budget-s)"}]
