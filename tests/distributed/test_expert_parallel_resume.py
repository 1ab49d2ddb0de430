"""Checkpoints of expert-parallel runs (issue 46): a tiny Qwen3-MoE (16 experts, top-4,
layers 1-3 sparse) trained by ``lmforge train`` with ``parallel.ep=2 parallel.dp_shard=2``
over 2 processes, each MoE layer's experts split 8 + 8 (DTensor ``Shard(0)``, beside
FSDP2's own shards):

- stopped after step 2 and resumed, it logs the straight run's losses bit for bit;
- its step-2 checkpoint resumes in one process (no ep, no FSDP: DCP reshards model and
  optimizer) and the other way, a one-process checkpoint under ep=2; the losses after the
  resume are both straight runs' to 1e-5 (measured: 9.6e-8 relative from the ep run's,
  the one-process run's bit for bit);
- its Hugging Face export is its final checkpoint's, exported offline in one process, bit
  for bit, and a straight one-process run's to 1e-5 (measured: 2.3e-6 after 4 steps at
  lr 1e-2, FSDP alone 7.4e-7: the gradients' sums run in another order, not the gather);
- its step-2 checkpoint also resumes at another degree on as many ranks (ep=1, FSDP over
  both);
- an ep=2 run with LoRA on the attention and the experts writes the adapter a
  one-process run writes (every expert's A and B, to 1e-5), with its losses;
- a resume with 8 experts is refused in one line naming ``model.n_experts``, the run
  directory untouched; the checkpoint's tensors, loaded into an 8-expert model directly,
  are refused naming the router's weight.

About 75 s on a 2-core CPU (12 launches)."""
import dataclasses
import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers.runs import read_metrics, run_lmforge, tiny_overrides
from lmforge.checkpoint import CheckpointError, load_checkpoint, read_model_state
from lmforge.checkpoint.state import read_meta
from lmforge.models.common import materialize
from lmforge.models.qwen3_moe.model import SparseArgs
from lmforge.models.registry import build_model

pytestmark = [pytest.mark.slow, pytest.mark.long]  # make test-long: about a minute
STEPS, STOP_AT = 4, 2
EP = ["parallel.dp_shard=2", "parallel.ep=2"]
LORA = ["lora.enabled=true", "lora.targets=all-linear", "lora.rank=4"]
STEP2 = f"checkpoints/step-{STOP_AT:07d}"


def _base(corpus: Path) -> list[str]:
    return ["model.preset=qwen3-moe-debug", *tiny_overrides(corpus, STEPS),
            "train.deterministic=true", "train.progress_bar=false"]


def _resumed_from(saved: Path, out: Path, base: list[str], layout: list[str],
                  nproc: int) -> Path:
    """``saved``'s step-2 checkpoint alone, copied to ``out`` and resumed on ``layout``."""
    shutil.copytree(saved / STEP2, out / STEP2)
    run_lmforge(out, base + layout + ["train.resume=auto"], nproc)
    return out


@pytest.fixture(scope="module")
def runs(tiny_corpus, tmp_path_factory):
    """name -> run directory: each layout's straight run and its run stopped after step 2
    (the ep one then resumed), each layout's step-2 checkpoint resumed on the other, and
    a copy of the ep run as it was stopped (for the refusals)."""
    root = tmp_path_factory.mktemp("ep-resume")
    base = _base(tiny_corpus)
    dirs = {name: root / name for name in ("ep", "ep_split", "one", "one_split")}
    for name, layout, nproc in (("ep", EP, 2), ("one", [], 1)):
        run_lmforge(dirs[name], base + layout, nproc)
        run_lmforge(dirs[name + "_split"], base + layout + [f"train.stop_at_step={STOP_AT}"],
                    nproc)
    dirs["stopped"] = root / "stopped"
    shutil.copytree(dirs["ep_split"], dirs["stopped"])
    dirs["ep_to_one"] = _resumed_from(dirs["ep_split"], root / "ep_to_one", base, [], 1)
    dirs["one_to_ep"] = _resumed_from(dirs["one_split"], root / "one_to_ep", base, EP, 2)
    # another degree on as many ranks: ep=1 (each rank every expert, FSDP-sharded)
    dirs["ep_to_fsdp"] = _resumed_from(dirs["ep_split"], root / "ep_to_fsdp", base,
                                       ["parallel.dp_shard=2"], 2)
    run_lmforge(dirs["ep_split"], base + EP + ["train.resume=auto"], 2)
    for name, layout, nproc in (("ep_lora", EP, 2), ("one_lora", [], 1)):
        dirs[name] = root / name
        run_lmforge(dirs[name], base + layout + LORA, nproc)
    return {"base": base, **dirs}


def _losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(out)}


def test_ep_run_stopped_and_resumed_equals_the_straight_run(runs):
    assert list(_losses(runs["ep_split"])) == list(range(1, STEPS + 1))
    assert _losses(runs["ep_split"]) == _losses(runs["ep"])
    final = f"checkpoints/step-{STEPS:07d}"
    want, got = read_model_state(runs["ep"] / final), read_model_state(runs["ep_split"] / final)
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.parametrize("moved", ["ep_to_one", "one_to_ep", "ep_to_fsdp"])
@pytest.mark.parametrize("straight", ["ep", "one"])
def test_checkpoint_resumes_on_the_other_layout(runs, moved, straight):
    got, want = _losses(runs[moved]), _losses(runs[straight])
    assert list(got) == list(range(STOP_AT + 1, STEPS + 1))
    for step, loss in got.items():
        assert loss == pytest.approx(want[step], rel=1e-5, abs=0), step


def _hf(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path / "model.safetensors")


def test_ep_export_is_its_checkpoint_and_the_one_process_run(runs, tmp_path):
    ep = _hf(runs["ep"] / "hf")
    offline = tmp_path / "offline"
    proc = subprocess.run([sys.executable, "-m", "lmforge.cli", "export",
                           str(runs["ep"] / f"checkpoints/step-{STEPS:07d}"), str(offline),
                           "--format", "hf"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    exported = _hf(offline)
    assert ep.keys() == exported.keys()
    assert all(torch.equal(ep[k], exported[k]) for k in ep), "the gather changed a weight"
    one = _hf(runs["one"] / "hf")
    assert ep.keys() == one.keys()
    assert any(".mlp.experts." in k for k in ep)
    for key in ep:
        torch.testing.assert_close(ep[key], one[key], rtol=0, atol=1e-5, msg=key)
    assert (runs["ep"] / "hf/config.json").read_text() == (runs["one"] / "hf/config.json").read_text()


def test_ep_lora_adapter_is_the_one_process_runs(runs):
    """The adapter an ep=2 run writes holds every expert's A and B (gathered from both
    ranks) in peft's layout, equal to a one-process run's."""
    ep, one = (load_file(runs[name] / "adapter" / "adapter_model.safetensors")
               for name in ("ep_lora", "one_lora"))
    assert ep.keys() == one.keys()
    experts = [k for k in ep if ".mlp.experts." in k]
    assert experts, sorted(ep)[:8]
    for key in ep:
        assert ep[key].shape == one[key].shape, key
        torch.testing.assert_close(ep[key], one[key], rtol=0, atol=1e-5, msg=key)
    assert _losses(runs["ep_lora"]) == pytest.approx(_losses(runs["one_lora"]), rel=1e-5)


def _tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_resume_with_another_expert_count_is_refused(runs):
    out = runs["stopped"]
    before = _tree_digest(out)
    proc = run_lmforge(out, runs["base"] + EP + ["train.resume=auto", "model.n_experts=8"],
                       nproc=2, check=False)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("lmforge: error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "model.n_experts is 16 in the checkpoint step-0000002 but 8 now" in errors[0]
    assert _tree_digest(out) == before


def test_checkpoint_tensors_refuse_a_model_of_another_expert_count(runs):
    checkpoint = runs["stopped"] / STEP2
    fields = read_meta(checkpoint)["model_args"]
    args = SparseArgs(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})
    model = materialize(build_model(args, "meta"), "cpu")
    load_checkpoint(checkpoint, model, None)  # the ep shards, whole in one process
    saved = read_model_state(checkpoint)
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    fewer = materialize(build_model(dataclasses.replace(args, n_experts=8), "meta"), "cpu")
    with pytest.raises(CheckpointError) as refused:
        load_checkpoint(checkpoint, fewer, None)
    assert "\n" not in str(refused.value)
    assert "model.layers.1.feed_forward.gate.weight" in str(refused.value)
