"""bench/ep_bench.py, expert parallelism's cost against FSDP2 alone: the median is taken
over the steps after the warm-up, a GPU row asking for more GPUs than are visible says so
in one line, and (slow) both layouts train a tiny Qwen3-MoE over 2 processes on the CPU
to the same loss."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


EP = _load("ep_bench")


def test_the_median_leaves_the_warmup_out_and_the_table_compares_with_fsdp():
    records = [{"step": s, "tokens_per_s": rate, "peak_mem_gib": 1.0, "loss": 2.0}
               for s, rate in ((1, 5.0), (2, 100.0), (3, 300.0), (4, 200.0))]
    row = EP.summarize(records, warmup=1, nproc=2)
    assert row["steps_timed"] == 3 and row["tokens_per_s"] == 200.0
    assert row["tokens_per_s_per_rank"] == 100.0 and row["tokens_per_s_min"] == 100.0
    assert "error" in EP.summarize(records, warmup=4, nproc=2)
    rounds = [{"tokens_per_s": 150.0}, {"tokens_per_s": 250.0}]
    rows = [{"name": "ep", "layout": "ep", "nproc": 2, **row, "rounds": rounds,
             "best_round_tokens_per_s": 250.0},
            {"name": "fsdp", "layout": "fsdp", "nproc": 2, **row, "tokens_per_s": 100.0,
             "rounds": rounds[:1], "best_round_tokens_per_s": 125.0}]
    assert "| ep | 2 | 200 (100-300) | 100 | 2.00x | 150, 250 | 2.00x | 1.00 |" in EP.table(rows)


def test_a_gpu_row_with_too_few_gpus_visible_is_skipped_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(EP, "gpus_visible", lambda: 1)
    monkeypatch.setattr(EP, "launch", lambda *a: pytest.fail("nothing should launch"))
    assert EP.main(["--device", "cuda", "--nproc", "8", "--shape", "preset"]) == 0
    assert capsys.readouterr().out == "skipped: ep=8 needs 8 GPUs, 1 visible\n"


@pytest.mark.slow
@pytest.mark.long  # (make test-long: kept out of make test's 15 minutes)
def test_both_layouts_train_a_tiny_moe_on_two_cpu_processes(tmp_path):
    """About 40 s on a 2-core CPU (two torchrun launches)."""
    tiny = ["--dim", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--head-dim",
            "16", "--experts", "8", "--top-k", "2", "--moe-ffn", "32", "--seq-len", "32",
            "--batch", "2", "--steps", "2", "--warmup", "1", "--json", str(tmp_path / "r.json")]
    proc = subprocess.run([sys.executable, str(BENCH / "ep_bench.py"), *tiny],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    result = json.loads((tmp_path / "r.json").read_text())
    ep, fsdp = result["rows"]
    assert (ep["name"], fsdp["name"]) == ("ep=2 dp_shard=2", "fsdp dp_shard=2")
    assert ep["steps_timed"] == fsdp["steps_timed"] == 2
    assert ep["tokens_per_s"] > 0 and fsdp["tokens_per_s"] > 0
    # the same model, data and seed: the layouts differ in where the experts run only
    assert ep["final_loss"] == pytest.approx(fsdp["final_loss"], rel=1e-4)
    assert "| ep=2 dp_shard=2 | 2 |" in proc.stdout and "torch" in result
