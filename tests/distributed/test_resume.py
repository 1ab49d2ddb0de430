"""Checkpoints in real runs: bit-exact resume, crash safety, resharding, NaN policy,
export of a sharded checkpoint."""
import hashlib
import json
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from helpers.runs import read_metrics, run_lmforge, tiny_overrides, weights_digest
from helpers.hf_models import load_reference

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("nproc, layout", [(1, []), (2, ["parallel.dp_shard=2"])],
                         ids=["single", "fsdp_dp2"])
def test_resume_is_bit_exact(tiny_corpus, tmp_path, nproc, layout):
    base = tiny_overrides(tiny_corpus, 6) + layout + ["train.deterministic=true",
                                                      "train.log_sample_ids=true"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    run_lmforge(straight, base, nproc)
    run_lmforge(split, base + ["train.stop_at_step=3"], nproc)
    assert not (split / "hf").exists()  # a stop is not the end of training
    run_lmforge(split, base + ["train.resume=auto"], nproc)
    a, b = read_metrics(straight), read_metrics(split)
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert [r["sample_ids"] for r in a] == [r["sample_ids"] for r in b]
    assert weights_digest(straight) == weights_digest(split)


@pytest.mark.long  # (make test-long: 18 s; test_checkpoint's interrupted writes stay)
def test_sigkill_during_checkpoint_write_keeps_the_previous_one(tiny_corpus, tmp_path):
    base = tiny_overrides(tiny_corpus, 6) + ["train.checkpoint_every=2",
                                             "train.deterministic=true", "train.keep_last=5"]
    signal_file = tmp_path / "in-commit"
    crashed = tmp_path / "crashed"
    proc = run_lmforge(crashed, base, fault="hang_commit:4", background=True,
                       env={"LMFORGE_TEST_SIGNAL": str(signal_file)})
    deadline = time.time() + 300
    while not signal_file.exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() < deadline, "the trainer never reached the step-4 commit"
        time.sleep(0.2)
    # The directory has one owner: a second run on it, even one that would resume, is
    # refused while the first is alive, naming the lock.
    second = run_lmforge(crashed, base + ["train.resume=auto"], check=False)
    assert second.returncode == 2, second.stderr[-2000:]
    assert second.stderr.count("\n") == 1 and "lmforge.lock" in second.stderr
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    ckpts = crashed / "checkpoints"
    assert (ckpts / "step-0000002").is_dir()
    assert (ckpts / "step-0000004.tmp").is_dir(), "killed mid-write, as intended"
    assert not (ckpts / "step-0000004").exists()

    # A fresh run (no resume) in the killed run's directory: refused, nothing touched.
    before = _tree_digest(ckpts)
    fresh = run_lmforge(crashed, base, check=False)
    assert fresh.returncode == 2 and "train.resume=auto" in fresh.stderr, fresh.stderr[-2000:]
    assert _tree_digest(ckpts) == before

    resumed = run_lmforge(crashed, base + ["train.resume=auto"])
    assert "resumed from" in resumed.stdout and "step-0000002" in resumed.stdout
    straight = tmp_path / "straight"
    run_lmforge(straight, base)
    # Each step recorded once (the killed invocation's steps 3-4 replaced by the resumed
    # ones), with the losses of the uninterrupted run; the summary covers the whole run.
    after = read_metrics(crashed)
    assert [r["step"] for r in after] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in after] == [r["loss"] for r in read_metrics(straight)]
    summaries = [json.loads((out / "summary.json").read_text()) for out in (crashed, straight)]
    assert summaries[0]["first_loss"] == summaries[1]["first_loss"]
    assert summaries[0]["last_loss"] == summaries[1]["last_loss"]
    assert not (ckpts / "step-0000004.tmp").exists(), "stale partial save cleaned up"


def _tree_digest(root) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


RESHARD_MODEL = ["model.n_heads=4", "model.n_kv_heads=4"]  # tp=4 divides the heads


@pytest.mark.long  # (a minute: make test-long)
def test_resume_on_other_layouts_reshards_model_and_optimizer(tiny_corpus, tmp_path):
    base = tiny_overrides(tiny_corpus, 3) + RESHARD_MODEL
    saved = tmp_path / "saved"
    run_lmforge(saved, base + ["parallel.dp_shard=2", "parallel.tp=2",
                               "train.stop_at_step=2"], nproc=4)
    layouts = {"same": ["parallel.dp_shard=2", "parallel.tp=2"],
               "dp4": ["parallel.dp_shard=4"],
               "tp4": ["parallel.tp=4"],
               "pp2_dp2": ["parallel.pp=2", "parallel.dp_shard=2"]}
    step3 = {}
    for name, layout in layouts.items():
        out = tmp_path / name
        shutil.copytree(saved, out)
        run_lmforge(out, base + layout + ["train.resume=auto"], nproc=4)
        step3[name] = read_metrics(out)[-1]
        assert step3[name]["step"] == 3
    for name in ("dp4", "tp4", "pp2_dp2"):
        assert step3[name]["loss"] == pytest.approx(step3["same"]["loss"], rel=1e-5), name
        assert step3[name]["grad_norm"] == pytest.approx(step3["same"]["grad_norm"], rel=1e-4)

    # The tp=2 x dp=2 run's final checkpoint, exported offline, equals its own export.
    pytest.importorskip("transformers")
    exported = tmp_path / "exported"
    proc = subprocess.run([sys.executable, "-m", "lmforge.cli", "export",
                           str(tmp_path / "same" / "checkpoints" / "step-0000003"),
                           str(exported), "--format", "hf"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ids = torch.randint(0, 301, (2, 24), generator=torch.Generator().manual_seed(0))
    logits = []
    for model_dir in (exported, tmp_path / "same" / "hf"):
        model = load_reference(model_dir)
        with torch.no_grad():
            logits.append(model(input_ids=ids).logits)
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)


@pytest.mark.parametrize("policy", ["skip", "stop"])
def test_nan_on_one_rank_is_caught(tiny_corpus, tmp_path, policy):
    out = tmp_path / policy
    base = tiny_overrides(tiny_corpus, 5) + ["parallel.dp_shard=2", "train.checkpoint_every=2",
                                             f"train.on_nonfinite={policy}"]
    proc = run_lmforge(out, base, nproc=2, fault="nan:1:3", check=False)
    assert "rank 1: step 3: non-finite loss nan on samples [" in proc.stderr
    if policy == "skip":
        assert proc.returncode == 0, proc.stderr[-3000:]
        records = read_metrics(out)
        assert [r["nonfinite_steps"] for r in records] == [0, 0, 1, 1, 1]
        assert all(torch.isfinite(t).all() for t in load_file(out / "hf" / "model.safetensors").values())
    else:
        assert proc.returncode != 0
        assert "train.on_nonfinite=stop" in proc.stderr
        names = sorted(p.name for p in (out / "checkpoints").iterdir())
        assert names == ["step-0000002"], names
        assert not (out / "hf").exists()


def test_under_torchrun_a_refused_config_is_one_line_from_rank_0(tiny_corpus, tmp_path):
    proc = run_lmforge(tmp_path / "run", tiny_overrides(tiny_corpus, 2) + [
        "parallel.dp_shard=2", f"train.resume={tmp_path / 'nowhere' / 'step-0000002'}"],
        nproc=2, check=False)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "lmforge: error:" in line]
    assert len(errors) == 1 and "train.resume:" in errors[0], proc.stderr[-3000:]
