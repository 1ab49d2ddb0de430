"""bf16 and fp16 on the CPU, run to their end as a user runs them (issue 44: every
mixed-precision CPU run trained, exported, then died in the end-of-run sample, whose packed
decode was handed autocast's half-precision input for an fp32 packed weight): `lmforge
train` through its held-out eval, export and sample; `lmforge generate` on half-precision
weights and with --dtype; a GRPO step, whose rollout and scoring share the decoder."""
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from helpers.grpo_prompts import grpo_overrides, sum_records, write_prompts
from helpers.preference_data import model_dir
from helpers.runs import read_metrics, run_lmforge, tiny_corpus, tiny_overrides  # noqa: F401

pytestmark = pytest.mark.slow


def _no_traceback(proc):
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]


@pytest.fixture(scope="module", params=["bf16", "fp16"])
def mixed_run(request, tiny_corpus, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp(request.param)
    proc = run_lmforge(out, [*tiny_overrides(tiny_corpus, 3), f"train.dtype={request.param}",
                             "data.eval_fraction=0.1", "train.sample_tokens=12",
                             "train.progress_bar=false"], check=False)
    return request.param, out, proc


def test_a_mixed_precision_cpu_run_ends_with_its_eval_export_and_sample(mixed_run):
    dtype, out, proc = mixed_run
    _no_traceback(proc)
    assert "sample (12 tokens" in proc.stdout  # (the end-of-run sample decoded)
    assert (out / "hf" / "model.safetensors").is_file()
    records = read_metrics(out)
    assert records[-1]["step"] == 3 and all(r["loss"] == r["loss"] for r in records)


def _generate(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmforge.cli", "generate", *args],
                          capture_output=True, text=True, timeout=300)


def test_generate_decodes_half_precision_weights_and_under_dtype(mixed_run, tmp_path):
    dtype, out, proc = mixed_run
    _no_traceback(proc)
    half = tmp_path / "half"
    half.mkdir()
    for f in (out / "hf").iterdir():
        (half / f.name).write_bytes(f.read_bytes())
    from safetensors.torch import save_file

    weights = load_file(out / "hf" / "model.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in weights.items()},
              half / "model.safetensors", metadata={"format": "pt"})
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "alpha beta"}\n{"prompt": "tensor"}\n')
    for model, extra in ((half, []), (out / "hf", ["--dtype", dtype])):
        written = tmp_path / f"o-{model.name}.jsonl"
        got = _generate("--model", str(model), "--prompts", str(prompts), "--output",
                        str(written), "--max-new-tokens", "6", "--greedy", *extra)
        _no_traceback(got)
        assert len(written.read_text().splitlines()) == 2


def test_a_bf16_grpo_step_rolls_out_scores_and_trains(tmp_path):
    data = write_prompts(tmp_path / "prompts.jsonl", sum_records(8))
    out = tmp_path / "run"
    proc = run_lmforge(out, [*grpo_overrides(model_dir(tmp_path), data, 1),
                             "train.dtype=bf16", "train.save=true", "train.sample_tokens=4",
                             "train.progress_bar=false"], check=False)
    _no_traceback(proc)
    record = read_metrics(out)[-1]
    assert record["step"] == 1 and "reward" in record and "eval_reward" in record, record
    assert "sample (4 tokens" in proc.stdout
