"""bench/speed_gpu.py, issue 40's GPU measurements in one script: every step's command is
one its bench script accepts, the plan skips what ran before and what the budget cannot
hold, and a dry run prints it without running anything."""
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
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


SPEED = _load("speed_gpu")


@pytest.mark.parametrize("step", SPEED.steps("/tmp/out"), ids=lambda s: s.name)
def test_every_step_is_a_command_its_bench_script_accepts(step):
    script, *argv = step.argv
    module = _load(Path(script).stem)
    parsed = module.parse_args(argv)  # (argparse exits on an unknown flag or value)
    assert parsed is not None


def test_the_plan_skips_finished_steps_and_those_the_budget_cannot_hold(tmp_path):
    plan = SPEED.steps("/tmp/out")
    done = tmp_path / "speed_gpu.jsonl"
    done.write_text(json.dumps({"name": plan[0].name, "rc": 0}) + "\n"
                    + json.dumps({"name": plan[1].name, "rc": 1}) + "\n")
    chosen = SPEED.runnable(plan, SPEED.done_before(done), plan[1].expect_s + 10)
    assert [s.name for s in chosen][0] == plan[1].name  # (it failed: it runs again)
    assert plan[0] not in chosen
    assert sum(s.expect_s for s in chosen) <= plan[1].expect_s + 10
    everything = SPEED.runnable(plan, set(), sum(s.expect_s for s in plan))
    assert everything == plan


def test_a_dry_run_prints_the_plan_and_runs_nothing(tmp_path):
    proc = subprocess.run([sys.executable, str(BENCH / "speed_gpu.py"), "--dry-run",
                           "--out", str(tmp_path / "o"), "--budget-s", "100000"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("python3 bench/") == len(SPEED.steps("x"))
    assert not (tmp_path / "o").exists()


def test_the_moe_rows_are_planned_and_only_selects_them():
    moe = SPEED.only(SPEED.steps("/tmp/out"), ["moe-30b"])
    assert [s.name for s in moe] == ["moe-30b-lora-2048", "moe-30b-lora-2048-ac"]
    for step in moe:
        assert "qwen3-30b-a3b" in step.argv and "all-linear" in step.argv
    assert SPEED.only(SPEED.steps("/tmp/out"), None) == SPEED.steps("/tmp/out")


@pytest.mark.slow
def test_the_moe_rows_command_runs_on_tiny_shapes_on_the_cpu(tmp_path):
    """The MoE step's own arguments, shrunk by shape overrides (later flags win), on the
    CPU, which computes fp32 (so without --base-dtype bf16): both sides train."""
    step = SPEED.only(SPEED.steps(str(tmp_path)), ["moe-30b-lora-2048"])[0]
    script, *argv = step.argv
    i = argv.index("--base-dtype")
    del argv[i:i + 2]
    tiny = ["--device", "cpu", "--dim", "64", "--layers", "2", "--heads", "4", "--kv-heads",
            "2", "--head-dim", "16", "--experts", "8", "--top-k", "2", "--moe-ffn", "64",
            "--vocab", "512", "--seq-len", "32", "--steps", "1", "--warmup", "0"]
    proc = subprocess.run([sys.executable, script, *argv, *tiny],
                          cwd=BENCH.parent, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "moe-30b-lora-2048.json").read_text())["results"]
    assert [r["side"] for r in results] == ["lmforge", "reference"]
    assert all("error" not in r and r["tokens_per_s"] > 0 for r in results), results
