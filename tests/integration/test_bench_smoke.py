"""The training-step benchmark runs on CPU and prints both columns and the ratio (a smoke
test: no timing is asserted, CI machines vary)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "train_step.py"


@pytest.mark.slow
def test_bench_train_step_reports_lmforge_against_the_reference(tmp_path):
    proc = subprocess.run([sys.executable, str(BENCH), "--preset", "tiny", "--device", "cpu",
                           "--seq-len", "64", "--batch", "2", "--steps", "2", "--warmup", "1",
                           "--json", str(tmp_path / "r.json")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| lmforge |" in proc.stdout and "| reference |" in proc.stdout
    assert "speed ratio lmforge/reference:" in proc.stdout
    assert (tmp_path / "r.json").is_file()


@pytest.mark.slow
def test_bench_low_memory_and_chunked_loss_options_run(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--preset", "debug", "--device", "cpu",
                           "--seq-len", "32", "--batch", "2", "--steps", "1", "--warmup", "1",
                           "--low-memory", "--loss-chunk-tokens", "16", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert [r["side"] for r in results] == ["lmforge", "reference"]
    assert all("error" not in r and r["tokens_per_s"] > 0 for r in results)
