"""The run's checkpoint policy: when to save, resume and prune (the mechanics live in
lmforge.checkpoint), and the seeding a resume on another layout falls back to."""
from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

from lmforge.checkpoint import (AsyncCheckpointer, capture_rng, load_checkpoint, read_meta,
                                resolve_resume, restore_rng)
from lmforge.config import JobConfig, samples_per_step
from lmforge.data.build import DataBundle
from lmforge.job import Job
from lmforge.train.model_setup import TrainModel
from lmforge.train.optim import Optimizers
from lmforge.train.resume_check import check_resume
from lmforge.train.run_dir import CHECKPOINTS


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class Checkpoints:
    """When to save, resume and prune; the mechanics live in lmforge.checkpoint."""

    def __init__(self, cfg: JobConfig, rt, out_dir: Path):
        self.cfg, self.rt = cfg, rt
        self.root = out_dir / CHECKPOINTS  # (cleaned of crashed saves when the run starts)
        self.writer = AsyncCheckpointer(self.root, keep_last=cfg.train.keep_last,
                                        use_async=cfg.train.async_checkpoint)
        self.tokens = 0  # positions the run's steps ran over, up to the resumed one

    def resume(self, model: TrainModel, optimizers: Optimizers, data: DataBundle,
               job: Job) -> int:
        """Loads ``train.resume`` (auto: the newest complete checkpoint that verifies) on
        any layout; returns the step to continue after (0 for a fresh start). ``job``: the
        run as its tokenizer sized it, checked against the checkpoint again (auto may
        fall back to an older one; a tokenizer trained since sizes the vocabulary)."""
        path = resolve_resume(self.cfg.train.resume, self.root,
                              verify=self.cfg.train.verify_checkpoint)
        if path is None:
            return 0
        check_resume(job, path)
        extra, rank_state = load_checkpoint(path, model.parts, optimizers.optimizers)
        optimizers.load_scheduler_state(extra["scheduler"])
        optimizers.scaler.load_state_dict(extra.get("loss_scale"))
        data.train.load_state_dict(extra["data"])
        step = int(extra["step"])
        self.tokens = int(extra.get("tokens", step * self.cfg.data.seq_len * samples_per_step(
            self.cfg, self.rt.dp_size)))  # saved without it: every row was seq_len wide
        if rank_state is not None and read_meta(path).get("world_size") == self.rt.world_size:
            restore_rng(rank_state)
        else:  # another layout: the old per-rank generators do not map onto the new ranks
            seed_everything(self.cfg.train.seed + step)
        if self.rt.is_logging_rank:
            print(f"resumed from {path} (step {step})", flush=True)
        return step

    def after_step(self, step: int, model: TrainModel, optimizers: Optimizers,
                   data: DataBundle, final: bool = False, now: bool = False,
                   tokens: int = 0) -> None:
        """Saves at ``train.checkpoint_every``, at the end (``train.save``), or ``now``
        (a stop signal: whatever train.save says, the run must be resumable)."""
        self.writer.maybe_finalize()
        every = self.cfg.train.checkpoint_every
        if not (now or (final and self.cfg.train.save) or (every and step % every == 0)):
            return
        extra = {"step": step, "scheduler": optimizers.scheduler_state(),
                 "data": data.train.state_dict(), "tokens": int(tokens),
                 "loss_scale": optimizers.scaler.state_dict()}
        self.writer.save(step, model.parts, optimizers.optimizers, extra, capture_rng(),
                         self.cfg.to_dict())

    def wait(self) -> None:
        self.writer.wait()
