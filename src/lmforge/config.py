"""Typed job configuration: dataclasses, YAML loading, ``key=value`` overrides, validation.

Every value that reaches the trainer passes through here. ``validate()`` runs before any
model is built or data is read, and every error names the field at fault, so a bad
config costs a second, not a queued GPU job.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import yaml


class ConfigError(ValueError):
    """A config value is wrong; the message starts with the dotted field name."""


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


@dataclass
class DataConfig:
    # stdlib: the Python standard library's sources (the CPU demo corpus);
    # text: local .txt/.py/.md files or directories; pretrain / sft: see data/.
    kind: str = "stdlib"
    path: Optional[Any] = None  # a path or a list of paths
    eval_path: Optional[Any] = None
    # Fraction of documents held out for validation when no eval_path is given.
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
    num_workers: int = 0


@dataclass
class OptimConfig:
    name: str = "adamw"
    # The defaults are the CPU demo's (no config file = the demo): a 3M-parameter model
    # takes a high peak LR. Recipes for real models set their own (1e-5 .. 3e-4).
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
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto (bf16 autocast on GPU, fp32 on CPU) | fp32 | bf16
    param_dtype: str = "fp32"  # fp32 master weights | bf16 weights (with optim.name=adamw_bf16)
    activation_checkpointing: str = "none"  # none | full | selective (every n-th block)
    activation_checkpointing_every: int = 2
    compile: bool = False
    deterministic: bool = False
    progress_bar: Optional[bool] = None  # None: on when stderr is a terminal
    log_sample_ids: bool = False  # write rank 0's sample ids of each logged step
    sample_prompt: str = "def "
    sample_tokens: int = 48
    threads: int = 0  # CPU threads for torch; 0 leaves torch's default
    # Write checkpoints in the background (training waits only for the copy to CPU).
    async_checkpoint: bool = False
    on_nonfinite: str = "stop"  # a NaN/Inf loss or grad norm: skip the step | stop
    # Apply the output layer and the loss this many tokens at a time, recomputing each
    # chunk's logits in backward (0: the whole micro-batch's logits at once).
    loss_chunk_tokens: int = 0


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
    # (typed Any so a plain string is accepted on the command line).
    targets: Any = field(default_factory=lambda: ["q_proj", "v_proj"])
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


# ---------------------------------------------------------------------------- loading

def load_config(path: Optional[str | Path] = None, overrides: list[str] = ()) -> JobConfig:
    """YAML file (or the embedded demo when None) + ``section.key=value`` overrides."""
    cfg = JobConfig()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path}: not found")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path}: not valid YAML ({_one_line(e)})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {path}: top level must be a mapping of sections")
        apply_dict(cfg, raw)
    for item in overrides:
        apply_override(cfg, item)
    return cfg


def apply_dict(cfg: JobConfig, raw: dict) -> None:
    for section, values in raw.items():
        if not hasattr(cfg, section) or not dataclasses.is_dataclass(getattr(cfg, section)):
            raise ConfigError(f"{section}: unknown config section "
                              f"(known: {', '.join(f.name for f in dataclasses.fields(cfg))})")
        if values is None:
            continue
        if not isinstance(values, dict):
            raise ConfigError(f"{section}: must be a mapping of keys to values")
        for key, value in values.items():
            set_field(cfg, f"{section}.{key}", value)


def apply_override(cfg: JobConfig, item: str) -> None:
    if "=" not in item:
        raise ConfigError(f"{item}: overrides are written section.key=value")
    key, text = item.split("=", 1)
    try:
        value = yaml.safe_load(text) if text != "" else None
    except yaml.YAMLError:
        value = text
    set_field(cfg, key.strip(), value)


def set_field(cfg: JobConfig, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    if len(parts) != 2:
        raise ConfigError(f"{dotted}: keys are written section.key (e.g. optim.lr)")
    section_name, key = parts
    section = getattr(cfg, section_name, None)
    if section is None or not dataclasses.is_dataclass(section):
        raise ConfigError(f"{dotted}: unknown config section '{section_name}'")
    hints = typing.get_type_hints(type(section))
    if key not in hints:
        known = ", ".join(f.name for f in dataclasses.fields(section))
        raise ConfigError(f"{dotted}: unknown key (known in {section_name}: {known})")
    setattr(section, key, _coerce(dotted, value, hints[key]))


def _coerce(name: str, value: Any, hint: Any) -> Any:
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none")):
            return None
        return _coerce(name, value, args[0])
    if hint is Any or hint is list and isinstance(value, list):
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{name}: expected true or false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{name}: expected an integer, got {value!r}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)  # YAML 1.1 reads "3e-4" as a string
            except ValueError:
                pass
        raise ConfigError(f"{name}: expected a number, got {value!r}")
    if hint is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{name}: expected a string, got {value!r}")
    if hint is list:
        if isinstance(value, list):
            return value
        raise ConfigError(f"{name}: expected a list, got {value!r}")
    return value


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())


def save_config(cfg: JobConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


# ------------------------------------------------------------------------- validation

_CHOICES = {
    "data.kind": ("stdlib", "text", "pretrain", "sft"),
    "data.template": CHAT_TEMPLATES,
    "optim.name": ("adamw", "adamw_bf16"),
    "train.param_dtype": ("fp32", "bf16"),
    "optim.schedule": ("cosine", "linear", "constant"),
    "train.device": ("auto", "cpu", "cuda"),
    "train.dtype": ("auto", "fp32", "bf16"),
    "train.activation_checkpointing": ("none", "full", "selective"),
    "train.on_nonfinite": ("skip", "stop"),
    "parallel.pp_schedule": ("gpipe", "1f1b", "interleaved_1f1b"),
}


def runs_distributed(parallel: ParallelConfig, world_size: int, torchrun: bool) -> bool:
    """Whether a run uses a process group and a device mesh: with several processes, and
    with one started by torchrun with ``parallel.dp_shard=1`` (FSDP2 on one device, so the
    distributed path can be checked on one GPU). Otherwise one plain process."""
    return world_size > 1 or (torchrun and parallel.dp_shard == 1)


def validate(cfg: JobConfig, world_size: int = 1, distributed: Optional[bool] = None) -> None:
    """Refuse a bad config before any compute; every message names the field.
    ``distributed``: see ``runs_distributed`` (default: several processes)."""
    distributed = world_size > 1 if distributed is None else distributed
    for dotted, allowed in _CHOICES.items():
        section, key = dotted.split(".")
        value = getattr(getattr(cfg, section), key)
        if value not in allowed and not (dotted == "data.template" and "{" in str(value)):
            raise ConfigError(f"{dotted}: {value!r} is not one of {', '.join(allowed)}")
    _positive(cfg, "data.seq_len", "data.micro_batch_size", "train.max_steps",
              "train.activation_checkpointing_every",
              "train.log_every", "data.tokenizer_vocab_size")
    _non_negative(cfg, "optim.weight_decay", "optim.grad_clip", "optim.warmup_steps",
                  "train.checkpoint_every", "train.eval_every", "train.keep_last",
                  "train.threads", "data.num_workers", "train.loss_chunk_tokens")
    if not cfg.optim.lr > 0:
        raise ConfigError(f"optim.lr: must be > 0, got {cfg.optim.lr}")
    if not 0 <= cfg.optim.min_lr_ratio <= 1:
        raise ConfigError(f"optim.min_lr_ratio: must be in [0, 1], got {cfg.optim.min_lr_ratio}")
    for beta in ("beta1", "beta2"):
        if not 0 <= getattr(cfg.optim, beta) < 1:
            raise ConfigError(f"optim.{beta}: must be in [0, 1)")
    if cfg.train.stop_at_step is not None and cfg.train.stop_at_step < 1:
        raise ConfigError(f"train.stop_at_step: must be >= 1, got {cfg.train.stop_at_step}")
    if not 0 <= cfg.data.eval_fraction < 1:
        raise ConfigError(f"data.eval_fraction: must be in [0, 1), got {cfg.data.eval_fraction}")
    if cfg.data.kind in ("text", "pretrain", "sft") and not cfg.data.path:
        raise ConfigError(f"data.path: required when data.kind is {cfg.data.kind}")
    _validate_batch(cfg, world_size)
    _validate_in_backward(cfg, world_size, distributed)
    _validate_model(cfg)
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


def _validate_batch(cfg: JobConfig, world_size: int) -> None:
    dp = data_parallel_size(cfg, world_size)
    per_step = cfg.data.micro_batch_size * dp
    gbs = cfg.data.global_batch_size
    if gbs is not None and (gbs <= 0 or gbs % per_step):
        raise ConfigError(f"data.global_batch_size: {gbs} must be a positive multiple of "
                          f"micro_batch_size x data-parallel size = {per_step}")


def _validate_in_backward(cfg: JobConfig, world_size: int, distributed: bool) -> None:
    if cfg.train.param_dtype == "bf16" and distributed:
        raise ConfigError("train.param_dtype: bf16 weights are for one process; with "
                          "several, FSDP2 keeps fp32 shards and computes in bf16")
    if not cfg.optim.in_backward:
        return
    # The update happens during backward, before the step's total gradient is known.
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


def data_parallel_size(cfg: JobConfig, world_size: int) -> int:
    p = cfg.parallel
    for name in ("dp_replicate", "tp", "pp"):
        if getattr(p, name) < 1:
            raise ConfigError(f"parallel.{name}: must be >= 1")
    rest = world_size // (p.dp_replicate * p.tp * p.pp) if world_size else 0
    dp_shard = rest if p.dp_shard == -1 else p.dp_shard
    if dp_shard < 1 or p.dp_replicate * dp_shard * p.tp * p.pp != world_size:
        raise ConfigError(
            f"parallel.dp_shard: dp_replicate({p.dp_replicate}) x dp_shard({p.dp_shard}) x "
            f"tp({p.tp}) x pp({p.pp}) must equal the world size {world_size}")
    return p.dp_replicate * dp_shard


def _validate_model(cfg: JobConfig) -> None:
    from lmforge.models.presets import PRESETS  # a leaf module: no cycle

    m = cfg.model
    if m.preset is not None and m.preset not in PRESETS:
        raise ConfigError(f"model.preset: unknown preset {m.preset!r} "
                          f"(known: {', '.join(sorted(PRESETS))})")
    if m.preset is None and m.init_from is None:
        raise ConfigError("model.preset: set a preset or model.init_from")
    if m.init_from is not None and not Path(m.init_from).is_dir():
        raise ConfigError(f"model.init_from: {m.init_from} is not a directory")
    for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim",
                 "max_seq_len"):
        value = getattr(m, name)
        if value is not None and value <= 0:
            raise ConfigError(f"model.{name}: must be > 0, got {value}")
    if m.init_from is not None:
        return  # shape checks against config.json happen when the directory is read
    args = model_args(cfg)
    check_model_args(args, cfg.data.seq_len)
    check_parallel_fits(cfg, args)


def _validate_lora(lora: LoraConfig) -> None:
    if lora.rank <= 0:
        raise ConfigError(f"lora.rank: must be > 0, got {lora.rank}")
    if not lora.alpha > 0:
        raise ConfigError(f"lora.alpha: must be > 0, got {lora.alpha}")
    if not 0 <= lora.dropout < 1:
        raise ConfigError(f"lora.dropout: must be in [0, 1), got {lora.dropout}")
    # lora.targets is checked by its one rule, lmforge.peft.targets.resolve_targets, which
    # the trainer and the estimate call right after validate(), before any compute.
    if lora.quantize is not None and lora.quantize not in QUANTIZE_FORMATS:
        raise ConfigError(f"lora.quantize: {lora.quantize!r} is not one of "
                          f"{', '.join(QUANTIZE_FORMATS)}")
    if lora.quantize and not lora.enabled:
        raise ConfigError("lora.quantize: a quantized base trains nothing without adapters "
                          "(set lora.enabled=true)")
    if lora.adapter_from is not None:
        if not lora.enabled:
            raise ConfigError("lora.adapter_from: set lora.enabled=true to load an adapter")
        if not (Path(lora.adapter_from) / "adapter_config.json").is_file():
            raise ConfigError(f"lora.adapter_from: {lora.adapter_from} has no "
                              f"adapter_config.json (a PEFT adapter directory)")


def check_parallel_fits(cfg: JobConfig, args) -> None:
    """Layout checks that need the model shape; run before any process group work."""
    p = cfg.parallel
    if p.zero not in (2, 3):
        raise ConfigError(f"parallel.zero: {p.zero} is not 2 or 3")
    if args.n_heads % p.tp or args.n_kv_heads % p.tp:
        raise ConfigError(f"parallel.tp: {p.tp} must divide n_heads ({args.n_heads}) and "
                          f"n_kv_heads ({args.n_kv_heads}); kv heads are not replicated")
    if p.pp_virtual_stages < 1:
        raise ConfigError("parallel.pp_virtual_stages: must be >= 1")
    if p.pp_schedule == "interleaved_1f1b" and p.pp > 1 and p.pp_virtual_stages < 2:
        raise ConfigError("parallel.pp_virtual_stages: interleaved_1f1b needs >= 2 stages "
                          "per rank")
    if p.pp_schedule != "interleaved_1f1b" and p.pp_virtual_stages != 1:
        raise ConfigError(f"parallel.pp_virtual_stages: only interleaved_1f1b uses virtual "
                          f"stages (pp_schedule is {p.pp_schedule})")
    if p.pp > 1:
        n_stages = p.pp * p.pp_virtual_stages
        if args.n_layers % n_stages:
            raise ConfigError(f"parallel.pp: {args.n_layers} layers do not split evenly into "
                              f"{n_stages} stages (pp x pp_virtual_stages)")
        if args.tie_embeddings:
            raise ConfigError("parallel.pp: tied embeddings (model.tie_embeddings) put the "
                              "embedding and the head on different stages; untie them")
        if cfg.data.document_mask or cfg.data.pack:
            raise ConfigError("parallel.pp: document masking / SFT packing is not supported "
                              "with pipeline parallelism yet")
    if p.microbatches is not None and p.microbatches < 1:
        raise ConfigError("parallel.microbatches: must be >= 1")


def check_model_args(args, seq_len: Optional[int] = None) -> None:
    if args.n_heads % args.n_kv_heads:
        raise ConfigError(f"model.n_kv_heads: n_heads ({args.n_heads}) must be divisible "
                          f"by n_kv_heads ({args.n_kv_heads})")
    if args.dim % args.n_heads:
        raise ConfigError(f"model.n_heads: dim ({args.dim}) must be divisible by "
                          f"n_heads ({args.n_heads})")
    if (args.dim // args.n_heads) % 2:
        raise ConfigError("model.n_heads: head_dim = dim / n_heads must be even for RoPE")
    if seq_len is not None and seq_len > args.max_seq_len:
        raise ConfigError(f"data.seq_len: {seq_len} exceeds the model's max_seq_len "
                          f"({args.max_seq_len})")


_ARG_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim",
               "max_seq_len", "rope_theta", "norm_eps", "tie_embeddings")


def model_args(cfg: JobConfig, base=None):
    """The model architecture: a preset (or ``base``, e.g. read from config.json) with the
    fields set in ``model.*`` on top."""
    from lmforge.models.presets import PRESETS

    args = base if base is not None else PRESETS[cfg.model.preset]
    changes = {k: getattr(cfg.model, k) for k in _ARG_FIELDS if getattr(cfg.model, k) is not None}
    if "n_heads" in changes and "n_kv_heads" not in changes and args.n_kv_heads == args.n_heads:
        changes["n_kv_heads"] = changes["n_heads"]
    return dataclasses.replace(args, **changes)


def _positive(cfg: JobConfig, *names: str) -> None:
    for dotted in names:
        section, key = dotted.split(".")
        if getattr(getattr(cfg, section), key) <= 0:
            raise ConfigError(f"{dotted}: must be > 0, got {getattr(getattr(cfg, section), key)}")


def _non_negative(cfg: JobConfig, *names: str) -> None:
    for dotted in names:
        section, key = dotted.split(".")
        if getattr(getattr(cfg, section), key) < 0:
            raise ConfigError(f"{dotted}: must be >= 0, got {getattr(getattr(cfg, section), key)}")


def resolve_device(name: str, field: str = "train.device", local_rank: int = 0):
    """The torch device ``auto`` | ``cpu`` | ``cuda`` means on this machine (auto: the GPU
    when one is visible); ``field`` names the setting in the error when none is."""
    import torch  # config is read by tools that never touch a tensor; torch loads on use

    if name not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"{field}: {name!r} is not one of auto, cpu, cuda")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{field}: cuda requested but no GPU is visible")
    use_cuda = name == "cuda" or (name == "auto" and torch.cuda.is_available())
    return torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
