"""What the memory estimate depends on: ``Setup`` (the model's shape, which weights train,
the layout, the dtypes), filled from a config exactly as the trainer would run it, and the
storage dtypes that follow from it (docs/estimate.md: R, C and the weights' storage)."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Optional


from lmforge.config import (ConfigError, compute_dtype, grad_accumulation_steps,
                            pipeline_microbatches, resolve_device, resolve_layout)
from lmforge.data.tokenizer import load_tokenizer
from lmforge.models.presets import resolve_model_args, validate_job
from lmforge.models.registry import family_of
from lmforge.parallel.parallelize import checkpointed_block
from lmforge.perf.flops import Trainability
from lmforge.peft.targets import LoraSpec, lora_spec

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass
class Setup:
    """Everything the estimate depends on; ``setup_from_config`` fills it from a config."""
    args: Any  # the family's args
    seq_len: int
    micro_batch: int  # sequences per micro-batch (with pp > 1: per pipeline microbatch)
    device: str = "cuda"  # cuda | cpu
    compute: str = "bf16"  # bf16 | fp16 (autocast, or FSDP2 half params) | fp32
    checkpointing: str = "none"  # none | full | selective (every checkpoint_every-th block)
    checkpoint_every: int = 2  # train.activation_checkpointing_every
    trainable: Trainability = field(default_factory=Trainability.full)
    lora: Optional[LoraSpec] = None
    optimizer: str = "adamw"
    fused_optimizer: Optional[bool] = None  # None: fused on cuda, per-tensor on cpu
    tp: int = 1
    pp: int = 1
    dp_shard: int = 1
    dp_replicate: int = 1
    zero: int = 3
    sequence_parallel: bool = True
    pp_schedule: str = "1f1b"
    pp_virtual_stages: int = 1
    microbatches: int = 1  # micro-batches per optimizer step (accumulation / pipeline)
    attention: str = "sdpa"  # sdpa (flash/efficient kernels) | eager (HF-style, S x S saved)
    loss_chunk_tokens: int = 0  # train.loss_chunk_tokens: logits made per chunk, recomputed
    param_dtype: str = "fp32"  # train.param_dtype: bf16 stores every weight in bf16
    activation_offload: bool = False  # train.activation_offload: blocks' saved tensors to host
    in_backward: bool = False  # optim.in_backward: each parameter stepped in backward
    notes: list = field(default_factory=list)  # assumptions worth printing

    def __post_init__(self):
        if self.lora is not None and self.trainable == Trainability.full():
            self.trainable = Trainability.lora(self.lora)  # LoRA trains only its adapters

    def checkpointed(self, layer_id: int) -> bool:
        """Whether block ``layer_id`` keeps only its input and recomputes the rest in
        backward: the trainer's rule (``parallel.parallelize.checkpointed_block``)."""
        return checkpointed_block(self.checkpointing, self.checkpoint_every, layer_id)

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp

    @property
    def fsdp(self) -> bool:
        """FSDP2 wraps the model whenever data parallelism is on (the trainer's rule); it
        shards over dp_shard and, with bf16, gathers the parameters as bf16 (no autocast)."""
        return self.dp_shard * self.dp_replicate > 1

    @property
    def half(self) -> bool:
        """Whether the model computes in a 2-byte dtype. bf16 and fp16 cost the same
        bytes everywhere but in a LoRA run's frozen base (``frozen_weight_dtype``); fp16's
        loss scaler holds two scalars."""
        return self.compute in ("bf16", "fp16")

    @property
    def autocast(self) -> bool:
        """Whether autocast makes half copies of fp32 weights (bf16 weights need none)."""
        return self.half and not self.fsdp and self.param_dtype == "fp32"


# ------------------------------------------------------------------- storage dtypes

def frozen_weight_dtype(setup: Setup) -> str:
    """Storage of frozen, unquantized projection weights, as the trainer keeps them: bf16
    for a LoRA run computing in bf16 without quantization (``frozen_linears_to_bf16``),
    else fp32 (fp16 included: the trainer keeps an fp16 run's frozen base in fp32);
    ``--base-dtype`` overrides."""
    if setup.param_dtype == "bf16":
        return "bf16"
    if setup.lora is not None and setup.lora.base_dtype:
        return str(setup.lora.base_dtype)
    if setup.lora is not None and not setup.lora.quantize and setup.compute == "bf16":
        return "bf16"
    return "fp32"


def compute_bytes(setup: Setup) -> int:
    """C in docs/estimate.md: bytes of the compute dtype, so of matmul outputs, logits and
    parameters FSDP2 gathers."""
    return 2 if setup.half else 4


def residual_bytes(setup: Setup) -> int:
    """R in docs/estimate.md: bytes of the residual stream, the embedding's output dtype.
    Autocast leaves the lookup alone, so under autocast it is the embedding's storage."""
    if not setup.half:
        return 4
    if setup.fsdp or setup.param_dtype == "bf16":
        return 2
    return 4 if setup.trainable.embedding else DTYPE_BYTES[frozen_weight_dtype(setup)]


def adapter_bytes(setup: Setup) -> int:
    """Bytes of a LoRA adapter's weights (and so of the input it keeps without autocast):
    2 bytes when FSDP2 gathers half parameters or every weight is bf16, else fp32."""
    return 2 if (setup.fsdp and setup.half) or setup.param_dtype == "bf16" else 4


# ----------------------------------------------------------------------- from config

def setup_from_config(cfg, device: Optional[str] = None, world_size: Optional[int] = None,
                      attention: str = "sdpa", base_dtype: Optional[str] = None) -> Setup:
    """A validated JobConfig -> Setup. ``device`` overrides train.device; ``world_size``
    resolves parallel.dp_shard=-1 (default: 1 device per unset dimension); ``base_dtype``
    (fp32 | bf16) is the storage of a LoRA run's frozen, unquantized weights."""
    layout = cfg.parallel
    # Without a world size, each unset dimension is one device (dp_shard=-1 resolves to 1).
    devices = world_size or layout.dp_replicate * layout.tp * layout.pp * max(layout.dp_shard, 1)
    dp_shard = resolve_layout(layout, devices)["dp_shard"]
    validate_job(cfg, world_size=devices)
    notes: list[str] = []
    args = resolve_model_args(cfg, _tokenizer_vocab(cfg, notes))
    device = device or cfg.train.device
    if device == "auto":  # this machine's (an explicit cuda is estimated even without one)
        device = resolve_device("auto").type
    compute = compute_dtype(cfg, device)
    dp = layout.dp_replicate * dp_shard
    microbatches, micro_batch = grad_accumulation_steps(cfg, dp), cfg.data.micro_batch_size
    if layout.pp > 1:  # the pipeline splits each rank's sequences of a step anew
        microbatches = pipeline_microbatches(cfg, dp)
        micro_batch = micro_batch * grad_accumulation_steps(cfg, dp) // microbatches
    return Setup(args=args, seq_len=cfg.data.seq_len, micro_batch=micro_batch,
                 device=device, compute=compute,
                 checkpointing=cfg.train.activation_checkpointing,
                 checkpoint_every=cfg.train.activation_checkpointing_every,
                 trainable=Trainability.from_config(cfg, args), lora=_lora(cfg, args, base_dtype),
                 optimizer=cfg.optim.name, fused_optimizer=cfg.optim.fused, tp=layout.tp,
                 pp=layout.pp, dp_shard=dp_shard, dp_replicate=layout.dp_replicate,
                 zero=layout.zero, sequence_parallel=layout.sequence_parallel,
                 pp_schedule=layout.pp_schedule, pp_virtual_stages=layout.pp_virtual_stages,
                 microbatches=microbatches, attention=attention,
                 loss_chunk_tokens=cfg.train.loss_chunk_tokens,
                 param_dtype=cfg.train.param_dtype, in_backward=cfg.optim.in_backward,
                 activation_offload=cfg.train.activation_offload,
                 notes=notes)


def _tokenizer_vocab(cfg, notes: list[str]) -> Optional[int]:
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


def _lora(cfg, args, base_dtype: Optional[str]) -> Optional[LoraSpec]:
    """The run's LoRA spec, with ``--base-dtype`` as the frozen weights' storage."""
    spec = lora_spec(cfg, family_of(args).projections)
    if spec is not None and base_dtype:
        if base_dtype not in ("fp32", "bf16"):
            raise ConfigError(f"--base-dtype: {base_dtype!r} is not fp32 or bf16")
        spec = dataclasses.replace(spec, base_dtype=base_dtype)
    return spec
