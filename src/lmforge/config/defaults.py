"""Defaults that depend on what the run is.

The schema's own defaults are the CPU demo's: a 3M-parameter model trained from scratch,
which takes a high peak LR, a fixed 20-step warmup and a code prompt for its sample. A run
that starts from a model (``model.init_from``) is fine-tuning: ``load_config`` gives it
the table below instead, for each key its YAML and ``key=value`` overrides did not set (a
value given explicitly always wins). README.md ("Fine-tuning defaults") states the table.

The run directory is named for the run too (``run_output_dir``): a run loaded from a config
file takes ``runs/<the file's stem>``, a fine-tune given on the command line
``runs/<init_from's directory name>``; only the demo (neither) writes to ``runs/demo``.
The name is stable, not stamped with the time: every rank of a job and every requeued
attempt (``train.resume=auto``) must find the same directory.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Collection, Optional

from lmforge.config.schema import JobConfig

# Peak LRs as fine-tuning recipes (LLaMA-Factory, Axolotl, torchtune) set them: full
# fine-tuning 1e-5 .. 2e-5, LoRA / QLoRA adapters 1e-4 .. 3e-4.
FULL_FINE_TUNING_LR = 2e-5
LORA_LR = 2e-4
# Warmup as a share of train.max_steps (rounded up), not a fixed count a short run may
# never get through.
WARMUP_FRACTION = 0.03
RUNS_ROOT = "runs"  # where a run directory named for its config or init_from goes


def fine_tuning_defaults(cfg: JobConfig) -> dict[str, Any]:
    """The table: ``section.key`` -> its default for a run starting from model.init_from.
    model.preset is cleared: the shapes come from init_from's config.json, so the saved
    config and ``lmforge report`` name the run by init_from, not by the demo's preset.
    train.sample_prompt None: the sample's prompt comes from the held-out data
    (lmforge.train.sample)."""
    return {"optim.lr": LORA_LR if cfg.lora.enabled else FULL_FINE_TUNING_LR,
            "optim.warmup_steps": math.ceil(WARMUP_FRACTION * cfg.train.max_steps),
            "model.preset": None,
            "train.sample_prompt": None}


def apply_run_defaults(cfg: JobConfig, explicit: Collection[str],
                       config_path: Optional[str | Path] = None) -> None:
    """Gives a run with model.init_from the fine-tuning defaults on each key not in
    ``explicit`` (the ``section.key`` names its config set), and any run its directory's
    name (``run_output_dir``) unless it set train.output_dir."""
    if "train.output_dir" not in explicit:
        cfg.train.output_dir = run_output_dir(cfg, config_path)
    if not cfg.model.init_from:
        return
    for dotted, value in fine_tuning_defaults(cfg).items():
        section, key = dotted.split(".")
        if dotted not in explicit:
            setattr(getattr(cfg, section), key, value)


def run_output_dir(cfg: JobConfig, config_path: Optional[str | Path] = None) -> str:
    """``runs/<config file stem>``; without a file, ``runs/<init_from's name>`` for a
    fine-tune; else the schema's (the demo's) directory."""
    if config_path is not None:
        return f"{RUNS_ROOT}/{Path(config_path).stem}"
    if cfg.model.init_from:
        return f"{RUNS_ROOT}/{model_dir_name(cfg.model.init_from)}"
    return cfg.train.output_dir


def model_dir_name(path: str) -> str:
    """A model directory's name; for a Hugging Face cache snapshot
    (``models--org--name/snapshots/<hash>``) the model's, not the hash."""
    where = Path(os.path.abspath(path))
    if where.parent.name == "snapshots" and where.parent.parent.name.startswith("models--"):
        return where.parent.parent.name.split("--")[-1]
    return where.name or "model"


def warmup_warning(cfg: JobConfig) -> Optional[str]:
    """One line when the warmup does not end before the run does (the LR never reaches
    optim.lr), else None."""
    warmup, steps = cfg.optim.warmup_steps, cfg.train.max_steps
    if warmup < steps:
        return None
    return (f"warning: optim.warmup_steps ({warmup}) >= train.max_steps ({steps}): the "
            f"learning rate never reaches optim.lr ({cfg.optim.lr:g}); lower "
            f"optim.warmup_steps")
