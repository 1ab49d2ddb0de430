"""Setting a run up: its runtime (device, seeds, process groups, the parallel layout,
mixed precision), its run directory (claimed by rank 0, one error on every rank), its
tokenizer (the model's, or one trained on the corpus). What ``train.loop`` calls before
the first step."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from lmforge import fsio
from lmforge.checkpoint import (CheckpointError, checkpoint_step, is_complete,
                                list_checkpoints, resolve_resume, resume_is_auto)
from lmforge.config import ConfigError, JobConfig, resolve_device
from lmforge.data.build import check_tokenizer_source, train_corpus_tokenizer
from lmforge.data.tokenizer import Tokenizer, load_tokenizer
from lmforge.job import Job
from lmforge.parallel.mesh import DistEnv, ParallelDims, build_parallel_dims, init_distributed
from lmforge.train.checkpoints import seed_everything
from lmforge.train.precision import mixed_precision
from lmforge.train.run_dir import TOKENIZER_DIR, RunClaim, claim_run_dir, resumed_tokenizer


@dataclass
class Runtime:
    device: torch.device
    autocast: object  # a context-manager factory
    rank: int = 0
    world_size: int = 1
    dims: ParallelDims = ParallelDims()  # the layout (and its DeviceMesh when distributed)
    param_dtype: Optional[torch.dtype] = None  # FSDP's compute dtype for parameters
    started: float = field(default_factory=time.perf_counter)  # for the summary's wall time

    @property
    def is_logging_rank(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        return self.dims.dp_rank

    @property
    def dp_size(self) -> int:
        return self.dims.dp


def init_runtime(job: Job, env: DistEnv) -> Runtime:
    cfg, t = job.config, job.config.train
    device = resolve_device(job.device, "train.device", env.local_rank)
    device_type = device.type
    if t.threads:
        torch.set_num_threads(t.threads)
    seed_everything(t.seed)
    if t.deterministic:
        torch.use_deterministic_algorithms(True)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    init_distributed(env, device_type, job.distributed, cfg.parallel.timeout_s)
    dims = (build_parallel_dims(cfg.parallel, env.world_size, device_type)
            if job.distributed else ParallelDims())
    autocast, param_dtype = mixed_precision(job.compute, device_type, dims.uses_fsdp)
    return Runtime(device=device, autocast=autocast, rank=env.rank,
                   world_size=env.world_size, dims=dims, param_dtype=param_dtype)


def prepare_output_dir(cfg: JobConfig, rt: Runtime) -> tuple[Path, Optional[RunClaim]]:
    """Rank 0 claims ``train.output_dir`` (its lock and the fresh-run rule, see
    ``run_dir``); every rank raises the same one-line error when that fails. Returns the
    directory and, on rank 0, the claim (``start_run`` once the run is past its checks,
    ``RunClaim.undo`` if it is refused before)."""
    out = Path(cfg.train.output_dir)
    claim, error = None, None
    if rt.is_logging_rank:
        try:
            claim = claim_run_dir(cfg, out)
        except ConfigError as e:
            error = str(e)
    error = from_rank0(rt, error)
    if error:
        raise ConfigError(error)
    return out, claim


def start_run(cfg: JobConfig, rt: Runtime, claim: Optional[RunClaim]) -> None:
    """The run is past every check: rank 0 writes ``config.yaml`` (and ends what
    ``train.overwrite`` set aside); every rank raises the same error when that fails."""
    error = None
    if claim is not None:
        try:
            claim.start(cfg)
        except OSError as e:
            error = (f"train.output_dir: cannot write to {claim.run_dir} "
                     f"({e.strerror or e})")
    error = from_rank0(rt, error)
    if error:
        raise ConfigError(error)


def check_resume_path(resume: Optional[str], root: Path) -> None:
    """An explicit ``train.resume`` path is checked before any set-up (``auto`` is
    resolved once the run directory is claimed): it must be a complete checkpoint, and
    none of a later step may sit in this run's ``root``. Continuing from step N beside
    later ones (a rewind, or another run's) would leave those to the next ``auto``."""
    if not resume or resume_is_auto(resume):
        return
    if not is_complete(resume):
        try:
            resolve_resume(resume, Path(resume))  # raises, saying what the path is instead
        except CheckpointError as e:
            raise ConfigError(str(e)) from None
    step = checkpoint_step(resume)
    later = [p.name for p in list_checkpoints(root) if checkpoint_step(p) > step]
    if later:
        raise ConfigError(
            f"train.resume: {resume} is older than {later[-1]} in {root}; a later "
            f"train.resume=auto would continue that one. Move the later checkpoints "
            f"away, or resume into another train.output_dir")


def prepare_tokenizer(cfg: JobConfig, out_dir: Path, rt: Runtime,
                      claim: Optional[RunClaim] = None) -> Tokenizer:
    """The model's tokenizer, or one trained on the corpus (and saved in the run dir). An
    earlier run's ``tokenizer/`` is set aside with the claim, not overwritten: put back if
    the run is refused before it starts, deleted once it starts."""
    source = cfg.model.tokenizer or cfg.model.init_from
    if source:
        return load_tokenizer(source)
    check_tokenizer_source(cfg)  # (before saying it trains one)
    saved = out_dir / TOKENIZER_DIR
    if rt.is_logging_rank and resumed_tokenizer(cfg) is None:  # one rank trains it
        say(rt, f"tokenizer: training a {cfg.data.tokenizer_vocab_size}-token BPE "
                 f"tokenizer on {data_source(cfg)}, saved in {saved}")
        tokenizer = train_corpus_tokenizer(cfg)
        if claim is not None and os.path.lexists(saved):
            claim.set_aside[TOKENIZER_DIR] = fsio.set_aside(saved, "deleting")
        tokenizer.save(saved)
    barrier(rt)
    return load_tokenizer(saved)


def barrier(rt: Runtime) -> None:
    if dist.is_initialized():
        dist.barrier()


def from_rank0(rt: Runtime, value):
    """``value`` as rank 0 has it, on every rank (also a barrier)."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def data_source(cfg: JobConfig) -> str:
    d = cfg.data
    if d.kind == "stdlib":
        return "the Python standard library (data.kind=stdlib)"
    where = d.blend if d.kind == "pretrain" and d.blend else d.path
    return f"{where} (data.kind={d.kind})"


def say(rt: Runtime, message: str) -> None:
    if rt.is_logging_rank:
        print(message, flush=True)
