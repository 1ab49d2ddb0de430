"""A run's paths made absolute once, at start (config/paths.py): each path key, lists of
paths, data.blend's prefixes, a resume checkpoint and the files of rl.rewards; built-in
names, ``auto``, numbers and unset keys as they were."""
import os

from lmforge.config import JobConfig
from lmforge.config.paths import with_absolute_paths


def _config(**keys) -> JobConfig:
    cfg = JobConfig()
    for dotted, value in keys.items():
        section, key = dotted.split("__")
        setattr(getattr(cfg, section), key, value)
    return cfg


def test_relative_paths_become_absolute_under_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = _config(model__init_from="models/m", data__path=["a.jsonl", "/abs/b.jsonl"],
                  data__eval_path="held.jsonl", train__output_dir="runs/x",
                  train__resume="runs/x/checkpoints/step-0000002", lora__adapter_from="ad",
                  rl__rewards="exact_answer,r/f.py:score")
    out = with_absolute_paths(cfg)
    here = str(tmp_path)
    assert out.model.init_from == os.path.join(here, "models/m")
    assert out.data.path == [os.path.join(here, "a.jsonl"), "/abs/b.jsonl"]
    assert out.data.eval_path == os.path.join(here, "held.jsonl")
    assert out.train.output_dir == os.path.join(here, "runs/x")
    assert out.train.resume == os.path.join(here, "runs/x/checkpoints/step-0000002")
    assert out.lora.adapter_from == os.path.join(here, "ad")
    assert out.rl.rewards == f"exact_answer,{os.path.join(here, 'r/f.py')}:score"
    assert out.model.tokenizer is None and cfg.data.eval_path == "held.jsonl"  # (a copy)


def test_blend_prefixes_resume_auto_and_reward_lists_keep_their_form(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = _config(data__blend=[0.3, "web/text", 0.7, "/abs/code"], train__resume="auto",
                  rl__rewards=["length", "f.py:g"])
    out = with_absolute_paths(cfg)
    assert out.data.blend == [0.3, os.path.join(str(tmp_path), "web/text"), 0.7, "/abs/code"]
    assert out.train.resume == "auto"
    assert out.rl.rewards == ["length", f"{tmp_path}/f.py:g"]
