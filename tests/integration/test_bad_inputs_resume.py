"""A resume refuses what it cannot continue, and a refused run leaves its directory as it
was (issue 37, point 2).

A resume continues one model and one objective: a checkpoint's model (its resolved shape,
family, head split, vocabulary, RoPE, LoRA adapters) and its objective (with the keys its
loss reads) must equal the new config's, else the run is refused before any compute,
naming the key, the checkpoint's value and the new one. Every refusal, of a resume or of a
fresh run, before or after the run's set-up, leaves the run directory byte for byte as it
was (a directory that did not exist does not exist afterwards). The rows run on copies of
two short runs trained once per session (``resume_runs``)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers.bad_inputs import (Bad, check_refused, edit_tensors, model_with, params,
                                poison, snapshot, steps, write)
from helpers.preference_data import pairs, write_pairs
from helpers.tiny_models import tiny_model_overrides
from lmforge.cli import main

# The text run: a 4-layer tiny Llama on the shared corpus, checkpointed at step 2.
TEXT = [*tiny_model_overrides(n_layers=4, vocab_size=384), "model.tokenizer={tokenizer}",
        "data.kind=text", "data.path={text}", "data.eval_fraction=0", "data.seq_len=32",
        "data.micro_batch_size=2", "train.max_steps=2", "train.save=false",
        "train.checkpoint_every=2", "train.device=cpu", "optim.warmup_steps=0"]
# The preference run: DPO with LoRA adapters on the shared tiny model.
PREF = ["model.init_from={model}", "data.kind=preference", "data.path={pairs}",
        "data.eval_fraction=0", "data.seq_len=64", "data.micro_batch_size=2",
        "lora.enabled=true", "lora.rank=4", "lora.targets=[q_proj,v_proj]",
        "train.objective=dpo", "train.max_steps=2", "train.save=false",
        "train.checkpoint_every=2",
        "train.device=cpu", "optim.warmup_steps=0"]
RUN = "train.output_dir={tmp}/run"
RESUME = [RUN, "train.resume=auto"]
STEP = "step-0000002"


def copy_run(name: str, to: str = "run"):
    """A setup: the session's run ``name`` copied to the row's ``{tmp}/<to>``."""
    def setup(tmp: Path, assets: dict) -> None:
        shutil.copytree(assets[name], tmp / to, symlinks=True)
    return setup


def changed(key: str, before: str, now: str) -> str:
    """The refusal's clause for one key (a regular expression)."""
    return rf"{key} is {before} in the checkpoint {STEP} but {now} now"


def text_resume(*overrides: str, message: str) -> tuple:
    return ["train", *TEXT, *overrides, *RESUME], rf"^train\.resume: .*{message}"


RESUME_ROWS = [
    Bad("resume with fewer layers",
        *text_resume("model.n_layers=2", message=changed(r"model\.n_layers", "4", "2")),
        setup=copy_run("text_run")),
    Bad("resume with more heads over the same matrices",
        *text_resume("model.n_heads=8", message=changed(r"model\.n_heads", "4", "8")),
        setup=copy_run("text_run")),
    Bad("resume with another kv-head count",
        *text_resume("model.n_kv_heads=4", message=changed(r"model\.n_kv_heads", "2", "4")),
        setup=copy_run("text_run")),
    Bad("resume with another head size",
        *text_resume("model.head_dim=16", message=changed(r"model\.head_dim", "8", "16")),
        setup=copy_run("text_run")),
    Bad("resume with another vocabulary",
        *text_resume("model.vocab_size=512",
                     message=changed(r"model\.vocab_size", "384", "512")),
        setup=copy_run("text_run")),
    Bad("resume with another MLP size",
        *text_resume("model.ffn_dim=128", message=changed(r"model\.ffn_dim", "64", "128")),
        setup=copy_run("text_run")),
    Bad("resume with another family",
        *text_resume("model.family=qwen2",
                     message=changed(r"model\.family", "llama", "qwen2")),
        setup=copy_run("text_run")),
    Bad("resume with untied embeddings",
        *text_resume("model.tie_embeddings=false",
                     message=changed(r"model\.tie_embeddings", "true", "false")),
        setup=copy_run("text_run")),
    Bad("resume with another rope theta",
        *text_resume("model.rope_theta=500000",
                     message=changed(r"model\.rope_theta", r"10000\.0", r"500000\.0")),
        setup=copy_run("text_run")),
    Bad("resume with another seed",
        *text_resume("train.seed=7", message=changed(r"train\.seed", "1234", "7")),
        setup=copy_run("text_run")),
    Bad("resume with two changes names both",
        *text_resume("model.n_layers=2", "model.ffn_dim=128",
                     message=changed(r"model\.ffn_dim", "64", "128") + "; "
                     + changed(r"model\.n_layers", "4", "2")),
        setup=copy_run("text_run")),
    Bad("resume from a path into a new run directory",
        ["train", *TEXT, "model.n_layers=3", "train.output_dir={tmp}/other",
         "train.resume={tmp}/run/checkpoints/" + STEP],
        r"^train\.resume: " + changed(r"model\.n_layers", "4", "3"),
        setup=copy_run("text_run")),
    Bad("resume dpo as ipo",
        ["train", *PREF, "train.objective=ipo", *RESUME],
        r"^train\.resume: .*" + changed(r"train\.objective", "dpo", "ipo"),
        setup=copy_run("pref_run")),
    Bad("resume dpo with another beta",
        ["train", *PREF, "train.beta=0.5", *RESUME],
        r"^train\.resume: .*" + changed(r"train\.beta", r"0\.1", r"0\.5"),
        setup=copy_run("pref_run")),
    Bad("resume dpo with label smoothing",
        ["train", *PREF, "train.label_smoothing=0.1", *RESUME],
        r"^train\.resume: .*" + changed(r"train\.label_smoothing", r"0\.0", r"0\.1"),
        setup=copy_run("pref_run")),
    Bad("resume with another lora rank",
        ["train", *PREF, "lora.rank=8", *RESUME],
        r"^train\.resume: .*" + changed(r"lora\.rank", "4", "8"), setup=copy_run("pref_run")),
    Bad("resume with other lora targets",
        ["train", *PREF, "lora.targets=[q_proj]", *RESUME],
        r"^train\.resume: .*" + changed(r"lora\.targets", r"\[q_proj, v_proj\]", r"\[q_proj\]"),
        setup=copy_run("pref_run")),
    Bad("resume with another lora alpha",
        ["train", *PREF, "lora.alpha=32", *RESUME],
        r"^train\.resume: .*" + changed(r"lora\.alpha", r"16\.0", r"32\.0"),
        setup=copy_run("pref_run")),
    Bad("resume with lora off",
        ["train", *PREF, "lora.enabled=false", *RESUME],
        r"^train\.resume: .*" + changed(r"lora\.enabled", "true", "false"),
        setup=copy_run("pref_run")),
]


def _break_shard(tmp: Path, assets: dict) -> None:
    """The run's only checkpoint with one byte of its weights changed."""
    shard = tmp / "run" / "checkpoints" / STEP / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


NAN_MODEL = model_with(edit_tensors("model/model.safetensors", poison("embed", float("nan"))))

AFTER_SET_UP_ROWS = [  # refused once the run directory is claimed: nothing stays
    Bad("fresh run from a model with a NaN weight",
        ["train", "model.init_from={tmp}/model", "data.kind=text", "data.path={text}",
         "data.seq_len=32", "train.max_steps=1", "train.device=cpu", "optim.warmup_steps=0", RUN],
        r"model", setup=NAN_MODEL),
    Bad("fresh run from a model with a NaN weight into a directory of other files",
        ["train", "model.init_from={tmp}/model", "data.kind=text", "data.path={text}",
         "data.seq_len=32", "train.max_steps=1", "train.device=cpu", "optim.warmup_steps=0", RUN],
        r"model", setup=steps(NAN_MODEL, write("run/notes.txt", "mine\n"))),
    Bad("overwrite of a run from a model with a NaN weight",
        ["train", "model.init_from={tmp}/model", "data.kind=text", "data.path={text}",
         "data.seq_len=32", "train.max_steps=1", "train.device=cpu", "optim.warmup_steps=0",
         "train.overwrite=true", RUN],
        r"model", setup=steps(NAN_MODEL, copy_run("text_run"))),
    Bad("resume whose only checkpoint does not verify",
        ["train", *TEXT, *RESUME],
        r"^train\.resume=auto: none of the 1 checkpoints under {tmp}/run/checkpoints "
        r"verifies", setup=steps(copy_run("text_run"), _break_shard)),
]

TABLE = RESUME_ROWS + AFTER_SET_UP_ROWS


@pytest.fixture(scope="session")
def resume_runs(bad_input_assets, tmp_path_factory) -> dict:
    """The shared assets plus ``text_run`` and ``pref_run``: two runs of 2 steps, each
    with its checkpoint (trained once per session) and ``{pairs}`` (preference JSONL)."""
    root = tmp_path_factory.mktemp("resume-runs")
    assets = {**bad_input_assets, "pairs": write_pairs(root / "pairs.jsonl", pairs(24))}
    names = {k: str(v) for k, v in assets.items()}
    for name, argv in (("text_run", TEXT), ("pref_run", PREF)):
        out = root / name
        filled = [_fill(a, names) for a in argv]
        assert main(["train", *filled, f"train.output_dir={out}"]) == 0, name
        assets[name] = out
    return assets


def _fill(text: str, names: dict) -> str:
    for key, value in names.items():
        text = text.replace("{" + key + "}", value)
    return text


@pytest.mark.parametrize("row", params(TABLE))
def test_resume_input_is_refused_in_one_line(row, resume_runs, tmp_path, capsys,
                                             monkeypatch):
    monkeypatch.delenv("LMFORGE_DEBUG", raising=False)
    capsys.readouterr()  # the session fixture's training output
    check_refused(row, resume_runs, tmp_path, capsys)


# ---------------------------------------------------------------- intended changes

def test_an_intended_change_is_announced_in_one_plain_line_and_the_run_continues(
        resume_runs, tmp_path, capsys, recwarn):
    """Data, learning rate and steps may change on a resume: each change is one plain
    line on stderr naming the key, both values and the checkpoint (no UserWarning)."""
    copy_run("text_run")(tmp_path, resume_runs)
    names = {k: str(v) for k, v in resume_runs.items()}
    argv = [_fill(a, names) for a in [*TEXT, "train.max_steps=3", "optim.lr=5e-4",
                                      "train.resume=auto", f"train.output_dir={tmp_path}/run"]]
    capsys.readouterr()
    assert main(["train", *argv]) == 0
    err = capsys.readouterr().err.splitlines()
    assert f"resume: optim.lr changed from 0.002 to 0.0005 (checkpoint {STEP})" in err
    assert f"resume: train.max_steps changed from 2 to 3 (checkpoint {STEP})" in err
    assert not [w for w in recwarn if "resume" in str(w.message)]
    records = [json.loads(line) for line in
               (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records][-1] == 3


def test_a_preset_spelled_out_is_the_same_model(resume_runs, tmp_path, capsys):
    """The resolved shape is compared: the checkpoint's tiny preset overridden field by
    field and the same shape written out differently resume without a refusal."""
    copy_run("text_run")(tmp_path, resume_runs)
    names = {k: str(v) for k, v in resume_runs.items()}
    argv = [_fill(a, names) for a in [*TEXT, "model.preset=debug",
                                      "model.tie_embeddings=true", "model.head_dim=8",
                                      "train.max_steps=3", "train.resume=auto",
                                      f"train.output_dir={tmp_path}/run"]]
    capsys.readouterr()
    assert main(["train", "--dry-run", *argv]) == 0, capsys.readouterr().err
    assert "model.preset" not in capsys.readouterr().err


def test_a_dry_run_refuses_a_changed_resume_and_writes_nothing(resume_runs, tmp_path,
                                                               capsys):
    copy_run("text_run")(tmp_path, resume_runs)
    before = snapshot(tmp_path)
    names = {k: str(v) for k, v in resume_runs.items()}
    argv = [_fill(a, names) for a in [*TEXT, "model.n_layers=2", "train.resume=auto",
                                      f"train.output_dir={tmp_path}/run"]]
    assert main(["train", "--dry-run", *argv]) == 2
    assert "model.n_layers is 4 in the checkpoint" in capsys.readouterr().err
    assert snapshot(tmp_path) == before
