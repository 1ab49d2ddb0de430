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
    assert [s.name for s in moe] == ["moe-30b-lora-2048", "moe-30b-lora-2048-ac",
                                     "moe-30b-ep8", "moe-30b-fsdp8"]
    for step in moe[:2]:
        assert "qwen3-30b-a3b" in step.argv and "all-linear" in step.argv
    assert SPEED.only(SPEED.steps("/tmp/out"), None) == SPEED.steps("/tmp/out")


def test_the_hybrid_rows_run_the_recipe_without_and_with_flas_wheels(tmp_path, monkeypatch):
    """Qwen3.5-9B with the recipe's LoRA, both sides on their PyTorch delta rules, then with
    flash-linear-attention's kernel wheels put on the step's path from .whl/."""
    plain, fla = SPEED.only(SPEED.steps("/tmp/out"), ["hybrid"])
    assert (plain.name, fla.name) == ("hybrid-9b-lora-4096", "hybrid-9b-lora-4096-fla")
    assert plain.wheels == () and fla.wheels == ("fla_core", "einops")
    assert "qwen3.5-9b" in plain.argv and plain.argv[1:-2] == fla.argv[1:-2]
    installed = []
    monkeypatch.setattr(SPEED, "ROOT", tmp_path)
    monkeypatch.setattr(SPEED.subprocess, "run", lambda argv, **kw: installed.append(argv))
    (tmp_path / ".whl").mkdir()
    for wheel in ("fla_core-0.6.0-py3-none-any.whl", "einops-0.8.1-py3-none-any.whl",
                  "bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl"):
        (tmp_path / ".whl" / wheel).touch()
    env = SPEED.step_env(fla.wheels)
    assert [Path(w).name for w in installed[0][-2:]] == [
        "einops-0.8.1-py3-none-any.whl", "fla_core-0.6.0-py3-none-any.whl"]
    assert env["PYTHONPATH"].split(":")[0] == "/tmp/speed_gpu_site-fla_core-einops"
    assert SPEED.step_env(())["PYTHONPATH"].split(":")[0] == str(tmp_path / "src")


def test_the_expert_parallel_rows_ask_for_8_gpus_and_fit_a_device_call():
    """Qwen3-30B-A3B's own shape at ep=8 (and FSDP2 alone), torchrun over 8 processes by
    ep_bench, each within what one call of the device machine allows."""
    ep, fsdp = SPEED.only(SPEED.steps("/tmp/out"), ["moe-30b-ep8", "moe-30b-fsdp8"])
    for step, layout in ((ep, "ep"), (fsdp, "fsdp")):
        parsed = _load("ep_bench").parse_args(step.argv[1:])
        assert step.gpus == 8 and parsed.nproc == 8 and parsed.device == "cuda"
        assert parsed.preset == "qwen3-30b-a3b" and parsed.shape == "preset"
        assert parsed.layouts == [layout] and step.expect_s <= 540
        assert parsed.json == f"/tmp/out/{step.name}.json"
    assert all(s.gpus == 1 for s in SPEED.steps("/tmp/out") if s not in (ep, fsdp))


def test_steps_that_need_more_gpus_are_left_out_without_taking_budget():
    plan = SPEED.steps("/tmp/out")
    budget = sum(s.expect_s for s in plan)
    one_gpu = SPEED.runnable(plan, set(), budget, gpus=1)
    assert [s.name for s in plan if s not in one_gpu] == ["moe-30b-ep8", "moe-30b-fsdp8"]
    assert SPEED.runnable(plan, set(), budget, gpus=0) == one_gpu  # (CPU: the 1-GPU plan)
    assert SPEED.runnable(plan, set(), budget, gpus=8) == plan
    # the budget of an 8-GPU step that cannot run is left to the steps after it
    ep8 = SPEED.only(plan, ["moe-30b-ep8"])[0]
    assert SPEED.runnable([ep8, plan[0]], set(), plan[0].expect_s, gpus=1) == [plan[0]]


def test_a_step_that_needs_more_gpus_is_skipped_with_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(SPEED, "gpus_visible", lambda: 1)
    monkeypatch.setattr(SPEED, "run", lambda *a: pytest.fail("nothing should run"))
    assert SPEED.main(["--out", str(tmp_path), "--only", "moe-30b-ep8", "--budget-s",
                       "600"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["moe-30b-ep8: skipped, needs 8 GPUs, 1 visible"]
    rows = [json.loads(line) for line in (tmp_path / "speed_gpu.jsonl").read_text().splitlines()]
    assert rows == [{"name": "moe-30b-ep8", "rc": "skipped", "reason": "needs 8 GPUs, 1 visible"}]
    assert SPEED.done_before(tmp_path / "speed_gpu.jsonl") == set()  # (it runs when it can)


@pytest.mark.slow
@pytest.mark.long  # (make test-long: about 16 s / 11 s on 2 cores)
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


@pytest.mark.slow
@pytest.mark.long  # (make test-long: kept out of make test's 15 minutes)
@pytest.mark.parametrize("name", ["moe-30b-ep8", "moe-30b-fsdp8"])
def test_the_expert_parallel_rows_runs_pass_the_trainers_dry_run_for_8_processes(name):
    """Their lmforge train, as ep_bench launches it, resolved for 8 processes and the
    model built on meta (no GPU needed): about 20 s each on a 2-core CPU."""
    step = SPEED.only(SPEED.steps("/tmp/out"), [name])[0]
    script, *argv = step.argv
    proc = subprocess.run([sys.executable, script, *argv, "--dry-run"], cwd=BENCH.parent,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    layout = "ep" if name.endswith("ep8") else "fsdp"
    assert proc.stdout.startswith(f"{layout}: dry run exit 0; memory: "), proc.stdout
