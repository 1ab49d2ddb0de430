"""A run's paths made absolute, once, at start (``train``): what changes the working
directory later (a user's reward function calling ``os.chdir``) then moves neither the
run's outputs (checkpoints, metrics, ``hf/``) nor what it reads (data, the model, a
reward's file). Relative paths are relative to the working directory the run started in,
as before; nothing is looked up on disk here (a missing file is refused where it is
read, naming it as it was given)."""
from __future__ import annotations

import copy
import os
from typing import Any

# (section, key) of each key that holds a path, or a list of them
PATH_KEYS = (("model", "init_from"), ("model", "tokenizer"), ("data", "path"),
             ("data", "eval_path"), ("train", "output_dir"), ("lora", "adapter_from"),
             ("eval", "harness_include_path"))


def with_absolute_paths(cfg):
    """A copy of ``cfg`` (a ``JobConfig``) whose relative paths are absolute: the keys of
    ``PATH_KEYS``, data.blend's prefixes, train.resume's checkpoint (not ``auto``) and the
    files of rl.rewards' ``path/to/file.py:function``."""
    cfg = copy.deepcopy(cfg)
    for section, key in PATH_KEYS:
        part = getattr(cfg, section)
        setattr(part, key, _absolute(getattr(part, key)))
    blend = cfg.data.blend
    if isinstance(blend, list) and len(blend) % 2 == 0:  # [weight, prefix, ...]
        cfg.data.blend = [_absolute(v) if i % 2 else v for i, v in enumerate(blend)]
    resume = cfg.train.resume
    if isinstance(resume, str) and resume.strip().lower() != "auto":
        cfg.train.resume = _absolute(resume)
    cfg.rl.rewards = _absolute_rewards(cfg.rl.rewards)
    return cfg


def _absolute(value: Any) -> Any:
    """A path string made absolute (a list: each of its strings); anything else, and an
    empty string, as it is."""
    if isinstance(value, list):
        return [_absolute(v) for v in value]
    if isinstance(value, str) and value.strip():
        return os.path.abspath(value)
    return value


def _absolute_rewards(value: Any) -> Any:
    """rl.rewards with each ``file.py:function``'s file absolute, in the form it was given
    (a list, or a comma-separated string); built-in names as they are."""
    if isinstance(value, str):
        return ",".join(absolute_reward(v) for v in value.split(","))
    if isinstance(value, list):
        return [absolute_reward(v) for v in value]
    return value


def absolute_reward(name: Any) -> Any:
    """One rl.rewards entry: ``path/to/file.py:function`` with the file absolute; a
    built-in name (or anything else) as it is."""
    if not isinstance(name, str):
        return name
    path, sep, func = name.strip().rpartition(":")
    return f"{os.path.abspath(path)}:{func}" if sep and path.endswith(".py") else name
