"""The training-step benchmark runs on CPU and prints both columns and the ratio (a smoke
test: no timing is asserted, CI machines vary)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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
@pytest.mark.long  # (12 s: make test-long)
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


def _load_bench():
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_step_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("side", ["lmforge", pytest.param("reference", marks=pytest.mark.long)])
def test_each_side_times_the_largest_listed_micro_batch_that_fits(side, monkeypatch):
    bench = _load_bench()
    real, tried = bench.timed_steps, []

    def oom_above_2(args, model_args, step, optimizer, batch, device):
        tried.append(batch)
        if batch > 2:  # (what a GPU too small for the micro-batch raises mid-step)
            step(*[torch.zeros(batch, args.seq_len, dtype=torch.long)] * 2)
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(args, model_args, step, optimizer, batch, device)
    monkeypatch.setattr(bench, "timed_steps", oom_above_2)
    args = bench.parse_args(["--preset", "debug", "--device", "cpu", "--seq-len", "16",
                             "--batch", "1,8,2,4", "--steps", "1", "--warmup", "0",
                             *(["--reference-compile"] if side == "reference" else []),
                             "--side", side])
    result = bench.run_side(args)
    assert tried == [8, 4, 2] and result["batch"] == 2
    assert result["tokens_per_s"] > 0


@pytest.mark.parametrize("text", ["0,2", "a", ""])
def test_bad_micro_batch_lists_are_refused_by_the_bench(text):
    with pytest.raises(SystemExit):
        _load_bench().parse_args(["--batch", text])


@pytest.mark.long  # (a whole-model compile on the CPU)
def test_the_compile_and_adamw_options_to_measure_run_on_lmforges_side_alone(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--preset", "debug", "--device", "cpu",
                           "--seq-len", "16", "--batch", "2", "--steps", "1", "--warmup", "1",
                           "--compile-whole", "--adamw", "foreach", "--fused-loss",
                           "--lmforge-only", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert [r["side"] for r in results] == ["lmforge"] and results[0]["tokens_per_s"] > 0


TINY_MOE = ["--preset", "qwen3-moe-debug", "--device", "cpu", "--dim", "64", "--layers", "2",
            "--experts", "8", "--top-k", "2", "--moe-ffn", "64", "--dense-layers", "none",
            "--seq-len", "32", "--batch", "2", "--steps", "1", "--warmup", "1"]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["full", pytest.param("lora", marks=pytest.mark.long)])
def test_an_moe_bench_compares_with_transformers_grouped_mm_from_the_same_weights(
        method, tmp_path):
    """The MoE shape overrides, the shared weights and both losses (cross-entropy +
    router_aux_loss_coef x aux): the first step's agree to 1e-4; the reference's experts
    ran as grouped_mm; LoRA trains as many parameters on both sides."""
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(BENCH), *TINY_MOE, "--method", method,
                           "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "first-step loss" in proc.stdout and "8 experts top-2" in proc.stdout
    ours, ref = json.loads(out.read_text())["results"]
    assert "error" not in ours and "error" not in ref, (ours, ref)
    assert ref["experts_implementation"] == "grouped_mm"
    assert abs(ours["losses"][0] - ref["losses"][0]) < 1e-4
    assert ours["trainable"] == ref["trainable"]


def test_a_shape_override_the_presets_args_lack_is_refused():
    bench = _load_bench()
    args = bench.parse_args(["--preset", "debug", "--experts", "8", "--side", "lmforge"])
    with pytest.raises(SystemExit, match="--experts"):
        bench.moe_bench.model_args(args.preset, args)
