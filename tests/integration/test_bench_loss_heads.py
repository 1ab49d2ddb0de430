"""bench/loss_heads.py and bench/train_step.py --fused-loss run on the CPU at tiny shapes,
so the GPU session's loss comparison cannot rot while no GPU is at hand."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_loss_heads_time_four_heads_that_give_one_loss_and_the_fused_hold_least(tmp_path):
    out = tmp_path / "heads.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "loss_heads.py"), "head",
                           "--device", "cpu", "--tokens", "256", "--dim", "32", "--vocab",
                           "4000", "--chunk", "64", "--steps", "1", "--warmup", "0",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["head"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["plain", "chunked", "fused", "fused per-token"]
    assert len({round(r["loss"], 2) for r in rows.values()}) == 1, rows
    # 256 x 4000 fp32 logits are 3.9 MiB; the fused head keeps a 64-token chunk's
    assert rows["fused"]["peak_mib"] < rows["plain"]["peak_mib"] / 3, rows
    assert "| fused per-token |" in proc.stdout


@pytest.mark.slow
def test_train_step_fused_loss_option_runs(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "train_step.py"), "--preset",
                           "debug", "--device", "cpu", "--seq-len", "32", "--batch", "2",
                           "--steps", "1", "--warmup", "1", "--fused-loss",
                           "--loss-chunk-tokens", "16", "--side", "lmforge"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    assert row["side"] == "lmforge" and row["tokens_per_s"] > 0
