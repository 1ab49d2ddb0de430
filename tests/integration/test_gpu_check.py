"""`bench/gpu_check.py` (``make gpu-check``) on the CPU with tiny shapes: the same list of
training paths a GPU slot runs, so the command cannot rot while no GPU is at hand."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PATHS = ["full, eager", "full, train.compile=true", "activation checkpointing full",
         "activation checkpointing full + activation offload",
         "activation checkpointing selective", "chunked loss", "fused loss",
         "low memory (bf16 weights, adamw_bf16, in backward)",
         "fp16 autocast, dynamic loss scaling", "FSDP2, one process (torchrun, dp_shard=1)",
         "LoRA", "QLoRA NF4", "LoRA, int8 base",
         "packed SFT, document masks", "packed SFT, document masks, flex",
         "long sequence, document masks, flex", "long sequence, document masks, sdpa",
         "generation, batch 1", "generation, batch 32", "checkpoint save, then resume",
         "profile: compiled, last 3 steps (torch.profiler)", "data.micro_batch_size=auto"]
GPU_ONLY = {"packed SFT, document masks, flex", "long sequence, document masks, flex",
            "data.micro_batch_size=auto"}


@pytest.mark.slow
@pytest.mark.long
def test_gpu_check_runs_every_path_on_tiny_cpu_shapes(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--device",
                           "cpu", "--tiny", "--out", str(tmp_path / "work"), "--report-dir",
                           str(tmp_path / "report")], capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    report = json.loads((tmp_path / "report" / "gpu_check.json").read_text())
    assert [r["path"] for r in report["paths"]] == PATHS
    for row in report["paths"]:
        if row["path"] in GPU_ONLY:  # a row saying why, not a failure
            assert row["ok"] is None and ("no backward on the CPU" in row["skipped"]
                                          or "refused on the CPU" in row["skipped"]), row
            continue
        assert row["ok"], row
        assert row["tokens_per_s"] > 0 and row["peak_allocated_gib"] > 0, row
        if not row["path"].startswith("generation, "):
            assert row["steps"] == report["steps"] and row["first_loss"] > 0, row
            assert "estimate_gib" in row or "estimate_error" in row, row
    by_name = {r["path"]: r for r in report["paths"]}
    assert by_name["checkpoint save, then resume"]["resume_max_rel_diff"] == 0.0
    profiled = by_name["profile: compiled, last 3 steps (torch.profiler)"]
    assert len(profiled["profile"]["top"]) == 15
    # every path starts from the same base and batch: the same first loss, bar quantization
    assert by_name["full, eager"]["first_loss"] == pytest.approx(
        by_name["FSDP2, one process (torchrun, dp_shard=1)"]["first_loss"], rel=1e-5)
    # train.save=false: the runs leave no checkpoint and no export behind
    runs = tmp_path / "work" / "runs"
    assert not any(runs.glob("full-eager/checkpoints/*")) and not (runs / "full-eager/hf").exists()
    assert [b["ok"] for b in report["benches"]] == [True, True, True], report["benches"]
    table = (tmp_path / "report" / "gpu_check.md").read_text()
    assert all(f"| {name} | ok |" in table for name in set(PATHS) - GPU_ONLY), table
    assert "| packed SFT, document masks, flex | skipped: FlexAttention has no backward" in table


@pytest.mark.slow
def test_gpu_check_starts_nothing_past_its_budget_and_writes_the_report_anyway(tmp_path):
    """--budget-s 0: every path and bench is a row marked skipped, in the report that a
    cut-off device call would bring back."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--device",
                           "cpu", "--tiny", "--out", str(tmp_path), "--budget-s", "0"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [r["path"] for r in report["paths"]] == PATHS
    assert {r["skipped"] for r in report["paths"] + report["benches"]} == {
        "time budget (--budget-s)"}
    assert "| full, eager | skipped: time budget (--budget-s) |" in (
        tmp_path / "gpu_check.md").read_text()


@pytest.mark.slow
@pytest.mark.long  # (20 s: make test-long)
def test_gpu_check_profile_path_writes_where_the_time_goes(tmp_path):
    """--only profile: torch.profiler over the compiled path's last steps (CPU activities
    here); the report lists the 15 operators with the most time and the shares of matmul,
    attention, elementwise, other and idle, which add up to the whole window."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--device",
                           "cpu", "--tiny", "--out", str(tmp_path), "--only", "profile",
                           "--no-benches"], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    (row,) = json.loads((tmp_path / "gpu_check.json").read_text())["paths"]
    assert row["path"].startswith("profile: ") and row["ok"], row
    profile = row["profile"]
    assert profile["device"] == "cpu" and len(profile["top"]) == 15
    times = [k["ms"] for k in profile["top"]]
    assert times == sorted(times, reverse=True) and times[0] > 0
    assert set(profile["shares"]) == {"matmul", "attention", "elementwise", "other", "idle"}
    assert sum(profile["shares"].values()) == pytest.approx(1.0)
    assert profile["shares"]["matmul"] > 0 and profile["shares"]["attention"] > 0
    assert {"aten::mm", "matmul"} <= {v for k in profile["top"] for v in (k["name"], k["kind"])}
    table = (tmp_path / "gpu_check.md").read_text()
    assert "Where the time goes (profile: compiled, last 3 steps" in table
    assert "| `aten::mm` | matmul |" in table
