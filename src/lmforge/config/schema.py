"""The job configuration's types (one dataclass per section) and ``validate()``; the
facts derived from a config are ``config.derived``. ``validate()`` runs before any model is built or data is read, and every error
names the field at fault, so a bad config costs a second, not a queued GPU job."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from lmforge.config.derived import pipeline_microbatches, resolve_layout
from lmforge.config.errors import ConfigError




@dataclass
class ModelConfig:
    # A named size from models/presets.py. Any field set below overrides the preset.
    preset: Optional[str] = "tiny"
    # A local Hugging Face model directory to start from (weights, config, tokenizer).
    init_from: Optional[str] = None
    # Directory holding tokenizer.json (defaults to init_from's, or the run's own).
    tokenizer: Optional[str] = None
    dim: Optional[int] = None
    n_layers: Optional[int] = None
    n_heads: Optional[int] = None
    n_kv_heads: Optional[int] = None
    vocab_size: Optional[int] = None
    ffn_dim: Optional[int] = None
    max_seq_len: Optional[int] = None
    rope_theta: Optional[float] = None
    norm_eps: Optional[float] = None
    tie_embeddings: Optional[bool] = None
    # A variant of the preset's family, by HF model_type: for a Llama-shaped preset
    # llama | mistral | qwen2 | qwen3 (models/llama/hf.py); gptj for a GPT-J one.
    family: Optional[str] = None
    head_dim: Optional[int] = None  # Llama family: heads sized apart from dim (Qwen3)
    sliding_window: Optional[int] = None  # model.family=mistral: keys a query sees
    rotary_dim: Optional[int] = None  # GPT-J: features of each head that rotate


@dataclass
class DataConfig:
    # stdlib: the Python standard library's sources (the CPU demo corpus);
    # text: local files or directories (.jsonl/.json/.parquet: the records' json_key,
    # other files whole; data/text.py); pretrain / sft: see data/.
    kind: str = "stdlib"
    path: Optional[Any] = None  # a path or a list of paths
    eval_path: Optional[Any] = None
    # Held out for validation when no eval_path is given: this fraction of a text corpus's
    # files (or its last tokens), of a pretrain prefix's documents, of an SFT file's samples.
    eval_fraction: float = 0.05
    seq_len: int = 256
    micro_batch_size: int = 8
    # Sequences per optimizer step over all data-parallel ranks; None = micro_batch_size x dp.
    global_batch_size: Optional[int] = None
    # Tokenizer vocabulary when lmforge trains one on the corpus (no model.tokenizer given).
    tokenizer_vocab_size: int = 2048
    json_key: str = "text"
    append_eod: bool = True
    # Chat template of SFT samples: auto (the tokenizer's own Jinja template, else plain),
    # one of CHAT_TEMPLATES, or a "{prompt}...{response}" format string (data/templates.py).
    template: str = "auto"
    blend: Optional[list] = None
    document_mask: bool = False
    pack: bool = False
    # SFT without packing: each batch is padded to its longest sample, rounded up to a
    # multiple of this (8; 64 suits GPU kernels best); 0 pads every batch to seq_len.
    pad_to_multiple_of: int = 8
    # SFT without packing: batch samples of similar length together (each epoch's shuffled
    # order is cut into spans of 64 optimizer steps, each sorted by length and cut into
    # steps, and the steps are shuffled), so batches padded to their longest pad less.
    group_by_length: bool = False
    num_workers: int = 0


@dataclass
class OptimConfig:
    name: str = "adamw"
    # The defaults are the CPU demo's (no config file = the demo): a 3M-parameter model
    # takes a high peak LR. A run with model.init_from gets fine-tuning defaults for lr and
    # warmup_steps instead, where its config leaves them unset (config/defaults.py).
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables clipping
    warmup_steps: int = 20
    schedule: str = "cosine"  # cosine | linear | constant
    fused: Optional[bool] = None  # None: fused where the device supports it
    # Step each parameter as soon as its gradient is ready and free the gradient
    # (low-memory full fine-tuning; no clipping or accumulation, one process).
    in_backward: bool = False


@dataclass
class TrainConfig:
    max_steps: int = 300
    seed: int = 1234
    output_dir: str = "runs/demo"
    log_every: int = 10
    eval_every: int = 0  # 0: only at the end
    eval_batches: int = 8
    checkpoint_every: int = 0  # 0: only at the end
    # false: no final checkpoint and no hf/ export (benchmarks, smoke runs); checkpoint_every
    # still applies.
    save: bool = True
    keep_last: int = 2
    # End this invocation after this step (checkpointed), keeping the schedule of
    # max_steps: for time-limited cluster jobs that resume with train.resume=auto.
    stop_at_step: Optional[int] = None
    resume: Optional[str] = None  # auto | a checkpoint path
    # A fresh run in an output_dir holding checkpoints is refused unless this says to
    # delete the earlier run's outputs (checkpoints, hf/, adapter/, logs) and start over.
    overwrite: bool = False
    # Check the checksums a checkpoint recorded before resuming from it (reads it all once,
    # shared by the ranks; docs/security.md gives the cost). resume=auto falls back to the
    # newest checkpoint that verifies.
    verify_checkpoint: bool = True
    device: str = "auto"  # auto | cpu | cuda
    # auto: bf16 autocast on a GPU with bf16 (fp16 on V100/T4), fp32 on CPU | fp32 | bf16 | fp16
    dtype: str = "auto"
    param_dtype: str = "fp32"  # fp32 master weights | bf16 weights (with optim.name=adamw_bf16)
    activation_checkpointing: str = "none"  # none | full | selective (every n-th block)
    activation_checkpointing_every: int = 2
    # What the transformer blocks save for backward (with checkpointing: their inputs) waits
    # in pinned CPU memory until backward needs it (parallel/offload.py); nothing on the CPU.
    activation_offload: bool = False
    compile: bool = False
    deterministic: bool = False
    progress_bar: Optional[bool] = None  # None: on when stderr is a terminal
    log_sample_ids: bool = False  # write rank 0's sample ids of each logged step
    # The end-of-run sample's prompt (the demo's code corpus: "def "); null, the default
    # with model.init_from: one taken from the held-out data (train/sample.py).
    sample_prompt: Optional[str] = "def "
    sample_tokens: int = 48
    threads: int = 0  # CPU threads for torch; 0 leaves torch's default
    # Write checkpoints in the background (training waits only for the copy to CPU).
    async_checkpoint: bool = False
    on_nonfinite: str = "stop"  # a NaN/Inf loss or grad norm: skip the step | stop
    # Apply the output layer and the loss this many tokens at a time, recomputing each
    # chunk's logits in backward (0: the whole micro-batch's logits at once).
    loss_chunk_tokens: int = 0
    # Weights & Biases logging (needs the wandb package): the project, else the
    # LMFORGE_WANDB_PROJECT environment variable, else off; the run's name there
    # (default: the output directory's name).
    wandb_project: Optional[str] = None
    wandb_run_name: Optional[str] = None
    # A run whose memory estimate (lmforge estimate) exceeds its device's memory (a GPU's
    # total, or the host's available memory on the CPU) is refused before anything is
    # allocated or written (perf/budget.py, docs/security.md); true runs it anyway.
    skip_memory_check: bool = False


@dataclass
class ParallelConfig:
    dp_replicate: int = 1
    dp_shard: int = -1  # -1: whatever is left of the world size
    tp: int = 1
    pp: int = 1
    pp_schedule: str = "1f1b"
    pp_virtual_stages: int = 1
    zero: int = 3
    sequence_parallel: bool = True
    microbatches: Optional[int] = None


CHAT_TEMPLATES = ("auto", "chatml", "plain", "llama2", "llama3")
QUANTIZE_FORMATS = ("nf4", "int8")  # lora.quantize: storage of a frozen (QLoRA) base


@dataclass
class LoraConfig:
    """LoRA / QLoRA fine-tuning (peft/). Off unless ``enabled``."""
    enabled: bool = False
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    # Projection names, aliases or groups, read by lmforge.peft.targets.resolve_targets
    # (typed Any so a plain string is accepted on the command line); None: the family's
    # default, as peft's (q_proj, v_proj; Phi-3's fused qkv_proj).
    targets: Any = None
    rslora: bool = False  # scale by alpha / sqrt(rank) instead of alpha / rank
    quantize: Optional[str] = None  # frozen base weights: nf4 (QLoRA) | int8
    adapter_from: Optional[str] = None  # a PEFT adapter directory to start from


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def validate(self, world_size: int = 1, distributed: Optional[bool] = None) -> "JobConfig":
        validate(self, world_size, distributed)
        return self


# ------------------------------------------------------------------------- validation

_CHOICES = {
    "data.kind": ("stdlib", "text", "pretrain", "sft"),
    "data.template": CHAT_TEMPLATES,
    "optim.name": ("adamw", "adamw_bf16"),
    "train.param_dtype": ("fp32", "bf16"),
    "optim.schedule": ("cosine", "linear", "constant"),
    "train.device": ("auto", "cpu", "cuda"),
    "train.dtype": ("auto", "fp32", "bf16", "fp16"),
    "train.activation_checkpointing": ("none", "full", "selective"),
    "train.on_nonfinite": ("skip", "stop"),
    "parallel.pp_schedule": ("gpipe", "1f1b", "interleaved_1f1b"),
    "parallel.zero": (2, 3),
    "lora.quantize": (None, *QUANTIZE_FORMATS),
}

# field -> the range its value must lie in (a key of _RANGES); unset (None) fields pass.
# Every number in the config has a range here, checked before any compute: a value out of
# it would otherwise fail late (a model built first) or with a message naming no field.
_BOUNDS = {
    **dict.fromkeys(("data.seq_len", "data.micro_batch_size", "data.tokenizer_vocab_size",
                     "train.max_steps", "train.log_every", "train.eval_batches",
                     "train.activation_checkpointing_every", "optim.lr", "lora.rank",
                     "lora.alpha", "model.dim", "model.n_layers", "model.n_heads",
                     "model.n_kv_heads", "model.vocab_size", "model.ffn_dim",
                     "model.max_seq_len", "model.head_dim", "model.sliding_window",
                     "model.rotary_dim", "model.rope_theta", "model.norm_eps", "optim.eps"),
                    "> 0"),
    **dict.fromkeys(("optim.weight_decay", "optim.grad_clip", "optim.warmup_steps",
                     "train.checkpoint_every", "train.eval_every", "train.keep_last",
                     "train.threads", "train.loss_chunk_tokens", "train.sample_tokens",
                     "data.num_workers", "data.pad_to_multiple_of"), ">= 0"),
    **dict.fromkeys(("train.stop_at_step", "parallel.dp_replicate", "parallel.tp",
                     "parallel.pp", "parallel.pp_virtual_stages", "parallel.microbatches"),
                    ">= 1"),
    "parallel.dp_shard": "-1 (the rest of the world size) or >= 1",
    # Seeds offset by the step and the rank must stay below torch's limit, 2^64.
    "train.seed": "in [0, 2^63)",
    "optim.min_lr_ratio": "in [0, 1]",
    **dict.fromkeys(("optim.beta1", "optim.beta2", "data.eval_fraction", "lora.dropout"),
                    "in [0, 1)"),
}
_RANGES = {"> 0": lambda v: v > 0, ">= 0": lambda v: v >= 0, ">= 1": lambda v: v >= 1,
           "-1 (the rest of the world size) or >= 1": lambda v: v == -1 or v >= 1,
           "in [0, 2^63)": lambda v: 0 <= v < 2**63,
           "in [0, 1]": lambda v: 0 <= v <= 1, "in [0, 1)": lambda v: 0 <= v < 1}


def validate(cfg: JobConfig, world_size: int = 1, distributed: Optional[bool] = None) -> None:
    """Refuse a bad config before any compute; every message names the field.
    ``distributed``: see ``parallel.mesh.runs_distributed`` (default: several processes)."""
    distributed = world_size > 1 if distributed is None else distributed
    for dotted, allowed in _CHOICES.items():
        value = _get(cfg, dotted)
        if value not in allowed and not (dotted == "data.template" and "{" in str(value)):
            raise ConfigError(f"{dotted}: {value!r} is not one of "
                              f"{', '.join(map(str, allowed))}")
    _validate_finite(cfg)
    for dotted, bound in _BOUNDS.items():
        value = _get(cfg, dotted)
        if value is not None and not _RANGES[bound](value):
            raise ConfigError(f"{dotted}: must be {bound}, got {value}")
    if cfg.data.kind in ("text", "pretrain", "sft") and not cfg.data.path:
        raise ConfigError(f"data.path: required when data.kind is {cfg.data.kind}")
    if cfg.train.overwrite and cfg.train.resume:
        raise ConfigError("train.overwrite: cannot be combined with train.resume (one starts "
                          "over, the other continues)")
    _validate_batch(cfg, world_size)
    _validate_grouping(cfg.data)
    _validate_in_backward(cfg, world_size, distributed)
    _validate_lora(cfg.lora)
    if cfg.lora.enabled and cfg.parallel.tp > 1:
        raise ConfigError("parallel.tp: LoRA under tensor parallelism is not supported yet "
                          "(use data parallelism / FSDP2 for LoRA)")
    if cfg.lora.quantize and distributed:
        raise ConfigError("lora.quantize: quantized (QLoRA) bases train in one plain process "
                          "(no FSDP2)")
    if cfg.train.loss_chunk_tokens and (cfg.parallel.tp > 1 or cfg.parallel.pp > 1):
        # tp: the vocab-parallel loss already splits the logits tp ways; pp: the last
        # stage's schedule owns the loss
        raise ConfigError("train.loss_chunk_tokens: supported with data parallelism / FSDP "
                          "only (set it to 0 with parallel.tp > 1 or parallel.pp > 1)")


def _get(cfg: JobConfig, dotted: str) -> Any:
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)


def _validate_finite(cfg: JobConfig) -> None:
    # inf passes every "> 0" bound and nan fails them with a puzzling message; either would
    # only show up as a non-finite loss (or a model of NaNs) a step or two into the run.
    for section in dataclasses.fields(cfg):
        values = getattr(cfg, section.name)
        for f in dataclasses.fields(values):
            value = getattr(values, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{section.name}.{f.name}: {value} is not a finite number")


def _validate_batch(cfg: JobConfig, world_size: int) -> None:
    layout = resolve_layout(cfg.parallel, world_size)
    dp_size = layout["dp_replicate"] * layout["dp_shard"]
    per_step = cfg.data.micro_batch_size * dp_size
    gbs = cfg.data.global_batch_size
    if gbs is not None and (gbs <= 0 or gbs % per_step):
        raise ConfigError(f"data.global_batch_size: {gbs} must be a positive multiple of "
                          f"micro_batch_size x data-parallel size = {per_step}")
    if cfg.parallel.pp > 1:
        pipeline_microbatches(cfg, dp_size)  # raises when the batch cannot be split


def _validate_grouping(data: DataConfig) -> None:
    if not data.group_by_length:
        return
    if data.kind != "sft":
        raise ConfigError(f"data.group_by_length: only SFT samples vary in length (data.kind "
                          f"is {data.kind}; its rows are all data.seq_len long)")
    if data.pack:
        raise ConfigError("data.group_by_length: cannot be combined with data.pack=true "
                          "(packing already removes the padding); set one of them")


def _validate_in_backward(cfg: JobConfig, world_size: int, distributed: bool) -> None:
    if cfg.train.param_dtype == "bf16" and (distributed or cfg.train.dtype == "fp16"):
        raise ConfigError("train.param_dtype: bf16 weights are for one process computing in "
                          "bf16 (FSDP2 keeps fp32 shards, fp16 keeps fp32 master weights)")
    if not cfg.optim.in_backward:
        return
    # The update happens in backward, before the step's total gradient (or fp16 overflow) is known.
    if cfg.train.dtype == "fp16":
        raise ConfigError("optim.in_backward: cannot be combined with train.dtype=fp16 (a "
                          "step whose gradients overflow must be skipped whole)")
    if cfg.optim.grad_clip:
        raise ConfigError("optim.grad_clip: must be 0 with optim.in_backward (the total "
                          "gradient norm is not known when each parameter is updated)")
    gbs = cfg.data.global_batch_size
    if gbs is not None and gbs != cfg.data.micro_batch_size * world_size:
        raise ConfigError("data.global_batch_size: gradient accumulation is impossible "
                          "with optim.in_backward (each backward updates the weights)")
    if distributed:
        raise ConfigError("optim.in_backward: supported in a single plain process only")
    if cfg.train.on_nonfinite != "stop":
        raise ConfigError("train.on_nonfinite: skip cannot undo an update made in "
                          "backward; use stop with optim.in_backward")


def _validate_lora(lora: LoraConfig) -> None:
    # lora.targets is checked by its one rule, lmforge.peft.targets.resolve_targets, which
    # the trainer and the estimate call right after validate(), before any compute.
    if lora.quantize and not lora.enabled:
        raise ConfigError("lora.quantize: a quantized base trains nothing without adapters "
                          "(set lora.enabled=true)")
    if lora.adapter_from is not None:
        if not lora.enabled:
            raise ConfigError("lora.adapter_from: set lora.enabled=true to load an adapter")
        if not (Path(lora.adapter_from) / "adapter_config.json").is_file():
            raise ConfigError(f"lora.adapter_from: {lora.adapter_from} has no "
                              f"adapter_config.json (a PEFT adapter directory)")
