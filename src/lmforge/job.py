"""A run's resolved facts: ``resolve(cfg, world_size)`` checks a config as the trainer
would and turns it into a frozen ``Job`` (the model, the layout, the batch arithmetic,
the device and dtypes, the LoRA spec, the objective). ``lmforge train`` (and its
``--dry-run``), ``estimate``, ``plan`` and ``launch slurm`` all read one; each fact below
is worked out by one function in ``config.derived`` or ``models.presets``, called from
here only.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from lmforge.config import (AUTO, ConfigError, JobConfig, compute_dtype,
                            grad_accumulation_steps, objective_name, pipeline_microbatches,
                            resolve_device, resolve_layout, samples_per_step)
from lmforge.data.tokenizer import load_tokenizer
from lmforge.models.attention import FLEX_MIN_HEAD_DIM
from lmforge.models.presets import (check_layout_fits, check_model_args, resolve_model_args,
                                    validate_job)
from lmforge.models.registry import ModelFamily, family_of
from lmforge.peft.targets import LoraSpec, lora_spec, resolve_targets

__all__ = ["Batch", "Job", "Layout", "READ_TOKENIZER", "resolve"]

# ``resolve``'s tokenizer_vocab default: read the size from the run's tokenizer directory
READ_TOKENIZER = object()


@dataclass(frozen=True)
class Layout:
    """The size of each mesh dimension, outermost first."""
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def fsdp_shard(self) -> int:
        """Ranks FSDP2 shards weights, gradients and optimizer states over: dp_shard, and
        the cp ranks with it (they hold the same weights; ``parallel.apply_data_parallel``)."""
        return self.dp_shard * self.cp


@dataclass(frozen=True)
class Batch:
    """The batch arithmetic of one optimizer step."""
    seq_len: int
    micro_batch_size: int  # data.micro_batch_size: sequences per rank per forward (pp=1)
    per_step: int  # sequences per optimizer step over all data-parallel ranks
    accumulation: int  # data.micro_batch_size micro-batches each rank runs per step
    # pp > 1: the pieces the schedule splits a rank's sequences of a step into (else None)
    pipeline_microbatches: Optional[int] = None
    # a preference pair is two (chosen, rejected), a GRPO prompt rl.num_generations
    sequences_per_sample: int = 1

    @property
    def microbatches(self) -> int:
        """Forward passes each stage makes per step: the accumulation, or the pipeline's."""
        pipeline = self.pipeline_microbatches
        return self.accumulation if pipeline is None else pipeline

    @property
    def micro_batch(self) -> int:
        """Samples (pairs) in each of those forward passes."""
        return self.micro_batch_size * self.accumulation // self.microbatches


@dataclass(frozen=True)
class Job:
    """Everything a run is, resolved and checked; ``config`` is a private copy, read-only
    by convention (a command that changes a key resolves again)."""
    config: JobConfig
    args: Any  # the family's model args
    layout: Layout
    batch: Batch
    distributed: bool  # process groups and the mesh (see parallel.mesh.runs_distributed)
    device: str  # cpu | cuda
    compute: str  # fp32 | bf16 | fp16
    lora: Optional[LoraSpec]
    objective: str  # what the step minimises (train.objectives)
    notes: tuple = ()  # assumptions worth printing (e.g. a tokenizer not trained yet)

    @property
    def family(self) -> ModelFamily:
        return family_of(self.args)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def data_kind(self) -> str:
        return self.config.data.kind

    def with_tokenizer(self, tokenizer_vocab: int) -> "Job":
        """This job once its tokenizer exists (trained on the corpus, or loaded): the
        model's vocabulary follows the tokenizer unless model.vocab_size sets it."""
        return resolve(self.config, self.world_size, distributed=self.distributed,
                       device=self.device, tokenizer_vocab=tokenizer_vocab)


def resolve(cfg: JobConfig, world_size: int = 1, *, distributed: Optional[bool] = None,
            device: Optional[str] = None, tokenizer_vocab: Any = READ_TOKENIZER,
            args: Any = None) -> Job:
    """``cfg`` on ``world_size`` processes, refused (``ConfigError`` naming the field)
    unless the trainer would run it. ``device`` (cpu | cuda) overrides train.device (an
    estimate for another machine); ``tokenizer_vocab`` is the run's tokenizer size
    (default: read from model.tokenizer / model.init_from, else the one the run will
    train); ``args``: the model, where the caller holds it already (a test's shapes)."""
    distributed = world_size > 1 if distributed is None else distributed
    if cfg.data.micro_batch_size == AUTO:  # a number from perf.auto_batch first
        raise ConfigError("data.micro_batch_size: auto is sized to a device's memory by "
                          "lmforge train and lmforge plan (lmforge estimate: with "
                          "--device-memory-gib); give a number here")
    notes: list[str] = []
    if args is None:
        validate_job(cfg, world_size=world_size, distributed=distributed)
        if tokenizer_vocab is READ_TOKENIZER:
            tokenizer_vocab = _tokenizer_vocab(cfg, notes)
        args = resolve_model_args(cfg, tokenizer_vocab)
    else:  # the model section is not read: only the config's own fields
        cfg.validate(world_size=world_size, distributed=distributed)
        check_model_args(args, cfg.data.seq_len)
        check_layout_fits(cfg, args)
    family = family_of(args)
    resolve_targets(cfg.lora.targets, family.projections)  # peft's one rule, by its names
    device = _device_type(device or cfg.train.device)
    _check_attention(cfg.model.attention, args, device)
    layout = Layout(**resolve_layout(cfg.parallel, world_size))
    return Job(config=copy.deepcopy(cfg), args=args, layout=layout,
               batch=_batch(cfg, layout), distributed=distributed, device=device,
               compute=compute_dtype(cfg, device), lora=lora_spec(cfg, family.projections),
               objective=objective_name(cfg), notes=tuple(notes))


def _check_attention(attention: str, args, device: str) -> None:
    """What FlexAttention cannot train: anything on the CPU (no backward there), and on
    CUDA heads under ``FLEX_MIN_HEAD_DIM`` features (else the compiler fails deep in the
    first step)."""
    if attention != "flex":
        return
    if device == "cpu":
        raise ConfigError("model.attention: flex cannot train on the CPU (PyTorch's "
                          "FlexAttention has no backward there); use sdpa on the CPU")
    if args.head_dim < FLEX_MIN_HEAD_DIM:
        raise ConfigError(f"model.attention: flex needs at least {FLEX_MIN_HEAD_DIM} "
                          f"features per head on CUDA, and this model's heads have "
                          f"{args.head_dim}; use sdpa")


def _batch(cfg: JobConfig, layout: Layout) -> Batch:
    dp = layout.dp
    return Batch(seq_len=cfg.data.seq_len, micro_batch_size=cfg.data.micro_batch_size,
                 per_step=samples_per_step(cfg, dp),
                 accumulation=grad_accumulation_steps(cfg, dp),
                 pipeline_microbatches=pipeline_microbatches(cfg, dp) if layout.pp > 1 else None,
                 sequences_per_sample=_sequences_per_sample(cfg))


def _sequences_per_sample(cfg: JobConfig) -> int:
    """The rows one sample trains as: a preference pair's two sides, a GRPO prompt's
    rl.num_generations completions."""
    return {"preference": 2, "prompts": cfg.rl.num_generations}.get(cfg.data.kind, 1)


def _device_type(name: str) -> str:
    """cpu | cuda: ``auto`` is this machine's; an explicit cuda stands without a GPU here
    (an estimate, a dry run or a launch script for another machine)."""
    return resolve_device("auto").type if name == "auto" else name


def _tokenizer_vocab(cfg: JobConfig, notes: list[str]) -> Optional[int]:
    """The size of the run's tokenizer: model.tokenizer's or model.init_from's (where the
    directory has one: an estimate may come from a config.json alone), or the one the
    run trains on its corpus where model.vocab_size does not size the model."""
    source = cfg.model.tokenizer or cfg.model.init_from
    if source and (cfg.model.tokenizer or Path(source, "tokenizer.json").is_file()):
        return load_tokenizer(source).vocab_size
    if cfg.model.init_from or cfg.model.vocab_size is not None:
        return None
    notes.append(f"vocab {cfg.data.tokenizer_vocab_size}: the tokenizer the run trains on "
                 f"its corpus (data.tokenizer_vocab_size); set model.vocab_size to change")
    return cfg.data.tokenizer_vocab_size

