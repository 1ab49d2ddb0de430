"""The embedded default end to end: `lmforge train` with no config (shortened), then its
Hugging Face export checked in transformers against `lmforge eval`."""
import json
import subprocess
import sys

import pytest
import torch

from lmforge.data.evalsets import text_eval_dataset
from lmforge.data.loader import BatchLoader
from lmforge.data.text import split_files, stdlib_files
from lmforge.data.tokenizer import load_tokenizer

from helpers.hf_models import load_reference

pytestmark = [pytest.mark.slow, pytest.mark.long]  # (a minute: make test-long)
STEPS = 100


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    cmd = [sys.executable, "-m", "lmforge.cli", "train", f"train.max_steps={STEPS}",
           "train.log_every=10", f"train.output_dir={out}", "train.sample_tokens=16"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc.stdout


def test_demo_writes_the_run_directory_contract(demo_run):
    out, stdout = demo_run
    for name in ("config.yaml", "metrics.jsonl", "tokenizer/tokenizer.json",
                 "hf/config.json", "hf/model.safetensors", "hf/tokenizer.json",
                 "hf/generation_config.json", "summary.json"):
        assert (out / name).is_file(), name
    assert list((out / "tensorboard").iterdir()), "no TensorBoard event file"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_mem_gib"):
        assert key in records[0], key
    assert records[-1]["step"] == STEPS
    assert f"Hugging Face export: {out / 'hf'}" in stdout
    assert "sample (" in stdout


def test_demo_lowers_the_loss_by_two_nats(demo_run):
    out, _ = demo_run
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # Batches differ in difficulty (stdlib files vary), so the end of the run is the
    # mean of its last three logged steps.
    end = sum(r["loss"] for r in records[-3:]) / 3
    assert records[0]["loss"] - end >= 2.0, [r["loss"] for r in records]


def test_export_loss_in_transformers_equals_lmforge_eval(demo_run, tmp_path):
    pytest.importorskip("transformers")
    out, _ = demo_run
    held_out = split_files(stdlib_files(), 0.05)[1]
    assert held_out, "the demo holds out some standard-library files"
    data = str(held_out[0])
    result_path = tmp_path / "eval.json"
    proc = subprocess.run(
        [sys.executable, "-m", "lmforge.cli", "eval", "--model", str(out / "hf"), "--data",
         data, "--seq-len", "128", "--output", str(result_path)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours = json.loads(result_path.read_text())

    hf = load_reference(out / "hf")
    tokenizer = load_tokenizer(out / "hf")
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in BatchLoader(text_eval_dataset([held_out[0]], tokenizer, 128),
                                 8).held_out_batches():
            logits = hf(input_ids=batch["input_ids"]).logits
            labels = batch["labels"].flatten()
            total += torch.nn.functional.cross_entropy(
                logits.flatten(0, 1).double(), labels, reduction="sum").item()
            count += int((labels != -100).sum())
    assert count == ours["tokens"]
    assert abs(total / count - ours["loss"]) < 1e-4
