"""What the memory estimate reads: ``Setup``, a view of the run's resolved ``Job`` (the
model's shape, which weights train, the layout, the dtypes) with the estimate's own
options, and the storage dtypes that follow from it (docs/estimate.md: R, C and the
weights' storage)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from lmforge.config import ConfigError
from lmforge.job import Job, resolve
from lmforge.models.preference import NEEDS_REFERENCE
from lmforge.models.registry import family_of
from lmforge.parallel.parallelize import checkpointed_block
from lmforge.perf.flops import Trainability
from lmforge.perf.linear_attention import LINEAR_PROJECTIONS, linear_layers
from lmforge.peft.targets import LoraSpec

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class Setup:
    """What the estimate reads: a resolved ``Job`` (its model, layout, batch, dtypes and
    config) and the estimate's own what-ifs; ``setup_from_config`` makes one."""
    job: Job
    attention: str = "sdpa"  # sdpa (flash/efficient kernels) | eager (HF-style, S x S saved)
    base_dtype: Optional[str] = None  # --base-dtype: a LoRA run's frozen weights' storage
    micro_batch_override: Optional[int] = None  # max_micro_batch's trial micro-batch

    @property
    def cfg(self):
        return self.job.config

    @property
    def args(self):
        return self.job.args

    @property
    def layout(self):
        return self.job.layout

    @property
    def batch(self):
        return self.job.batch

    @property
    def device(self) -> str:
        return self.job.device

    @property
    def compute(self) -> str:
        return self.job.compute

    @property
    def notes(self) -> tuple:
        return self.job.notes

    @property
    def micro_batch(self) -> int:
        """Sequences per forward pass (with pp > 1: per pipeline microbatch; a preference
        pair is two, its packed row of 2 x seq_len positions alike)."""
        samples = self.micro_batch_override or self.job.batch.micro_batch
        return samples * self.job.batch.sequences_per_sample

    @property
    def reference(self) -> str:
        """What a preference run's reference costs: "copy" (a frozen copy of the weights
        and a no-grad pass), "pass" (LoRA: the same weights, a no-grad pass), or "" (none
        during training: precomputed, or an objective without one)."""
        if self.job.objective == "grpo":  # (rl.beta > 0: the KL's reference)
            if not self.cfg.rl.beta:
                return ""
        elif self.job.objective not in NEEDS_REFERENCE or self.cfg.train.reference != "live":
            return ""
        return "pass" if self.lora is not None else "copy"

    @property
    def lora(self) -> Optional[LoraSpec]:
        spec = self.job.lora
        if spec is not None and self.base_dtype:
            return dataclasses.replace(spec, base_dtype=self.base_dtype)
        return spec

    @property
    def trainable(self) -> Trainability:
        """Which weights train: LoRA's adapters (with the norms and biases it names), or
        every weight."""
        if self.lora is None:
            return Trainability.full()
        family = family_of(self.args)
        present = (set(family.block(self.args).shapes) | set(family.projections.experts)
                   | set(LINEAR_PROJECTIONS if linear_layers(self.args) else ()))
        return Trainability.lora(self.lora, present)

    def checkpointed(self, layer_id: int) -> bool:
        """Whether block ``layer_id`` keeps only its input and recomputes the rest in
        backward: the trainer's rule (``parallel.parallelize.checkpointed_block``)."""
        t = self.cfg.train
        return checkpointed_block(t.activation_checkpointing,
                                  t.activation_checkpointing_every, layer_id)

    @property
    def fsdp(self) -> bool:
        """FSDP2 wraps the model whenever data or context parallelism is on (the trainer's
        rule); it shards over dp_shard x cp and, with bf16, gathers the parameters as bf16
        (no autocast)."""
        return self.layout.dp * self.layout.cp > 1

    @property
    def ep(self) -> int:
        """Expert-parallel ranks (``parallel.ep``, a divisor of dp_shard): each keeps
        ``n_experts / ep`` of every MoE layer's routed experts (parallel/expert.py),
        sharded further by FSDP over ``expert_shard`` ranks."""
        return self.cfg.parallel.ep

    @property
    def expert_shard(self) -> int:
        """The ranks FSDP shards each rank's local experts over under expert parallelism:
        dp_shard / ep (torchtitan's dp_shard_mod_ep); 1 when ep = dp_shard (the experts
        whole, no gather or reduce-scatter) and without ep (the experts then are FSDP's
        like every other weight, over the whole fsdp_shard)."""
        if self.ep == 1:
            return 1
        return max(self.layout.fsdp_shard // self.ep, 1)

    @property
    def experts_in_fsdp(self) -> bool:
        """Whether FSDP holds the local experts under expert parallelism (each MoE
        layer's experts its own unit, ``parallel.fsdp.apply_fsdp_to_experts``): whenever
        other data-parallel ranks hold the same experts, dp / ep > 1 (ep < dp_shard, or
        dp_replicate > 1: HSDP over dp_replicate x dp_shard / ep). It then reduces their
        gradients, and gathers them for their layer where it shards them
        (``expert_shard`` > 1); at ep = dp_shard without dp_replicate it ignores them."""
        return self.ep > 1 and self.layout.dp // self.ep > 1

    @property
    def local_seq(self) -> int:
        """Positions of each sequence on one device: context parallelism gives each of
        its ranks 1 / cp of every row (two chunks, parallel/context.py)."""
        return self.batch.seq_len // self.layout.cp

    @property
    def tokens(self) -> int:
        """Positions of one micro-batch on one device, whose activations the estimate
        counts per token."""
        return self.micro_batch * self.local_seq

    @property
    def half(self) -> bool:
        """Whether the model computes in a 2-byte dtype. bf16 and fp16 cost the same
        bytes everywhere but in a LoRA run's frozen base (``frozen_weight_dtype``); fp16's
        loss scaler holds two scalars."""
        return self.compute in ("bf16", "fp16")

    @property
    def autocast(self) -> bool:
        """Whether autocast makes half copies of fp32 weights (bf16 weights need none)."""
        return self.half and not self.fsdp and self.cfg.train.param_dtype == "fp32"


# ------------------------------------------------------------------- storage dtypes

def frozen_weight_dtype(setup: Setup) -> str:
    """Storage of frozen, unquantized projection weights, as the trainer keeps them: bf16
    for a LoRA run computing in bf16 without quantization (``frozen_linears_to_bf16``),
    else fp32 (fp16 included: the trainer keeps an fp16 run's frozen base in fp32);
    ``--base-dtype`` overrides."""
    if setup.cfg.train.param_dtype == "bf16":
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
    Autocast leaves the lookup alone, so under autocast it is the embedding's storage:
    fp32, trained or frozen (a LoRA run's bf16 base is its projections alone,
    ``frozen_linears_to_bf16``); bf16 where every weight is, or FSDP2 gathers it so."""
    if setup.half and (setup.fsdp or setup.cfg.train.param_dtype == "bf16"):
        return 2
    return 4


def adapter_bytes(setup: Setup) -> int:
    """Bytes of a LoRA adapter's weights (and so of the input it keeps without autocast):
    2 bytes when FSDP2 gathers half parameters or every weight is bf16, else fp32."""
    return 2 if (setup.fsdp and setup.half) or setup.cfg.train.param_dtype == "bf16" else 4


# ----------------------------------------------------------------------- from config

def setup_from_config(cfg, device: Optional[str] = None, world_size: Optional[int] = None,
                      attention: str = "sdpa", base_dtype: Optional[str] = None,
                      args: Any = None) -> Setup:
    """The estimate of ``cfg`` as the trainer would run it (``job.resolve``). ``device``
    overrides train.device; ``world_size`` resolves parallel.dp_shard=-1 (default: 1
    device per unset dimension); ``base_dtype`` (fp32 | bf16) is the storage of a LoRA
    run's frozen, unquantized weights; ``args``: the model, where the caller holds it."""
    p = cfg.parallel
    devices = world_size or p.dp_replicate * p.tp * p.pp * p.cp * max(p.dp_shard, 1)
    if base_dtype not in (None, "fp32", "bf16"):
        raise ConfigError(f"--base-dtype: {base_dtype!r} is not fp32 or bf16")
    return Setup(resolve(cfg, devices, device=device, args=args), attention=attention,
                 base_dtype=base_dtype)


def linear_lora_key(setup: Setup) -> tuple:
    """What ``perf/linear_attention.py``'s fake runs need of a LoRA run (hashable):
    (adapted projections, rank, alpha, dropout, frozen projections stored in bf16); ()
    without LoRA."""
    if setup.lora is None:
        return ()
    adapted = tuple(name for name, _ in setup.trainable.adapters)
    bf16 = frozen_weight_dtype(setup) == "bf16" and not setup.lora.quantize
    lora = setup.cfg.lora
    return adapted, lora.rank, lora.alpha, lora.dropout, bf16
