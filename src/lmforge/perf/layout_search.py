"""``lmforge plan``: every legal layout of a config on N GPUs, the ones whose estimated
memory fits, ranked by the predicted step time (perf/timing.py; docs/plan.md).

Each candidate is the input config with the layout keys set, turned into a ``Setup`` by
``setup_from_config`` (the path ``lmforge estimate`` takes), so the trainer's own
validation decides what is legal and the memory estimate decides what fits."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Iterator, Optional

from lmforge.config import ConfigError, JobConfig, set_field
from lmforge.models.registry import family_of
from lmforge.perf.estimate import GiB, estimate_memory
from lmforge.perf.linear_attention import linear_layers
from lmforge.perf.rollout import rollout_changes
from lmforge.perf.estimate_setup import Setup, setup_from_config
from lmforge.perf.timing import Device, StepTime, step_time

MEMORY_MARGIN = 0.05  # of device memory left free: allocator and estimate error
CHECKPOINTING = ("none", "selective", "full")
LOSS_CHUNK_TOKENS = 2048  # the chunk size plan tries for train.loss_chunk_tokens
MAX_GPUS = 8192  # the largest job "no layout fits" looks for


@dataclass
class Candidate:
    keys: dict  # section.key -> value: what this layout sets on the input config
    setup: Setup
    peak_gib: float
    time: StepTime

    def describe(self) -> str:
        s, k = self.setup, self.keys
        text = f"dp{s.layout.dp_replicate}x{s.layout.dp_shard} tp{s.layout.tp} pp{s.layout.pp}"
        if s.ep > 1:
            text += f" ep{s.ep}"
        if s.layout.cp > 1:
            text += f" cp{s.layout.cp}"
        if s.layout.pp > 1:
            text += f" {s.cfg.parallel.pp_schedule}" + (f"/v{s.cfg.parallel.pp_virtual_stages}"
                                           if s.cfg.parallel.pp_virtual_stages > 1 else "")
        text += f" mb{s.micro_batch} ac={s.cfg.train.activation_checkpointing}"
        if s.layout.dp_shard > 1:
            text += f" zero{s.cfg.parallel.zero}"
        if k.get("train.loss_chunk_tokens"):
            text += " chunked-loss"
        return text


@dataclass
class PlanResult:
    candidates: list = field(default_factory=list)  # those that fit, fastest first
    tried: int = 0  # legal layouts whose memory was estimated


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def global_batch(cfg: JobConfig, gpus: int) -> int:
    """Sequences per step the plan keeps fixed: data.global_batch_size, else one
    micro-batch per GPU."""
    return cfg.data.global_batch_size or cfg.data.micro_batch_size * gpus


def meshes(args, gpus: int, per_node: int, seq_len: int = 0) -> Iterator[dict]:
    """(dp_replicate, dp_shard, cp, tp, pp) with product ``gpus``: tp inside a node and
    dividing both head counts (and a hybrid's linear-attention key heads: a rank holds
    whole ones, ``models.tp.linear_attention_plan``), pp dividing the layers, cp with tp
    inside a node (its gathers run every layer) and splitting ``seq_len`` into 2 cp
    chunks (none without one). A mixture of experts: data parallelism only (the trainer
    refuses pp and cp for one: ``models.presets.check_layout_fits``; tp would run every
    expert whole on each tp rank, which the step time does not model), each mesh without
    ep and with every ep ``expert_parallel`` allows. The trainer's validation drops the
    rest (cp with pp, for one)."""
    moe = family_of(args).block(args).moe is not None
    hybrid = bool(linear_layers(args))
    for tp in divisors(min(gpus, per_node)):
        if (gpus % tp or args.n_heads % tp or args.n_kv_heads % tp
                or hybrid and args.linear_key_heads % tp or moe and tp > 1):
            continue
        for cp in divisors(per_node // tp if per_node % tp == 0 else 1):
            if gpus % (tp * cp) or cp > 1 and (not seq_len or seq_len % (2 * cp) or moe):
                continue
            for pp in divisors(gpus // (tp * cp)):
                if args.n_layers % pp or moe and pp > 1:
                    continue
                for rep in divisors(gpus // (tp * cp * pp)):
                    shard = gpus // (tp * cp * pp * rep)
                    mesh = {"parallel.dp_replicate": rep, "parallel.dp_shard": shard,
                            "parallel.cp": cp, "parallel.tp": tp, "parallel.pp": pp,
                            "parallel.ep": 1}  # (not the input config's)
                    yield mesh
                    for ep in expert_parallel(args, mesh):
                        yield {**mesh, "parallel.ep": ep}


def expert_parallel(args, mesh: dict) -> list[int]:
    """The ``parallel.ep`` > 1 an MoE's experts can split over on ``mesh``: each divisor of
    dp_shard that divides the experts (the rest of dp_shard, dp_shard / ep ranks, shards
    each rank's experts by FSDP), with pp and cp at 1 (refused for an MoE); none for a
    dense model."""
    moe = family_of(args).block(args).moe
    if moe is None or mesh["parallel.pp"] > 1 or mesh["parallel.cp"] > 1:
        return []
    return [ep for ep in divisors(mesh["parallel.dp_shard"])
            if ep > 1 and moe.n_experts % ep == 0]


def schedules(args, pp: int) -> list[dict]:
    """Pipeline schedules for ``pp`` stages: gpipe, 1f1b, and interleaved 1F1B with two
    virtual stages per rank when the layers split that finely."""
    if pp == 1:
        return [{"parallel.pp_schedule": "1f1b", "parallel.pp_virtual_stages": 1}]
    out = [{"parallel.pp_schedule": s, "parallel.pp_virtual_stages": 1}
           for s in ("gpipe", "1f1b")]
    if args.n_layers % (2 * pp) == 0:
        out.append({"parallel.pp_schedule": "interleaved_1f1b",
                    "parallel.pp_virtual_stages": 2})
    return out


def layouts(cfg: JobConfig, args, gpus: int, per_node: int) -> Iterator[dict]:
    """Every combination of mesh, schedule, micro-batch, checkpointing, ZeRO stage and
    chunked loss; the config validation later drops what the trainer refuses."""
    batch = global_batch(cfg, gpus)
    for mesh in meshes(args, gpus, per_node, cfg.data.seq_len):
        dp = mesh["parallel.dp_replicate"] * mesh["parallel.dp_shard"]
        if batch % dp:
            continue
        sharded = mesh["parallel.dp_shard"] > 1
        plain = mesh["parallel.tp"] == 1 and mesh["parallel.pp"] == 1
        for sched in schedules(args, mesh["parallel.pp"]):
            for mb in divisors(batch // dp):
                for ac in CHECKPOINTING:
                    for zero in ((2, 3) if sharded else (3,)):
                        for chunk in ((0, LOSS_CHUNK_TOKENS) if plain else (0,)):
                            yield {**mesh, **sched, "data.micro_batch_size": mb,
                                   "data.global_batch_size": batch,
                                   "train.activation_checkpointing": ac,
                                   "parallel.zero": zero, "train.loss_chunk_tokens": chunk}


def with_keys(cfg: JobConfig, keys: dict) -> JobConfig:
    out = copy.deepcopy(cfg)
    for dotted, value in keys.items():
        set_field(out, dotted, value)
    return out


def evaluate(cfg: JobConfig, keys: dict, gpus: int, per_node: int,
             device: Device) -> Optional[Candidate]:
    """The candidate ``keys`` make of ``cfg``, or None when the trainer would refuse it."""
    try:
        setup = setup_from_config(with_keys(cfg, keys), device=runs_on(device),
                                  world_size=gpus)
    except ConfigError:
        return None
    peak = estimate_memory(setup).total_bytes / GiB
    return Candidate(keys=keys, setup=setup, peak_gib=peak,
                     time=step_time(setup, device, per_node))


def runs_on(device: Device) -> str:
    """The trainer's train.device for ``device``: the estimate's overheads differ."""
    return "cpu" if device.part == "cpu" else "cuda"


def budget_gib(device: Device) -> float:
    return device.memory_gib * (1 - MEMORY_MARGIN)


def plan(cfg: JobConfig, gpus: int, per_node: int, device: Device) -> PlanResult:
    """The layouts of ``cfg`` on ``gpus`` devices that fit, fastest step first."""
    result = PlanResult()
    for keys in layouts(cfg, plan_args(cfg), gpus, per_node):
        cand = evaluate(cfg, keys, gpus, per_node, device)
        if cand is None:
            continue
        result.tried += 1
        if cand.peak_gib <= budget_gib(device):
            result.candidates.append(cand)
    result.candidates.sort(key=lambda c: (c.time.total, c.peak_gib))  # ties: the leaner
    return result


def plan_args(cfg: JobConfig):
    """The model's shape, as the estimate reads it (one legal layout: one device)."""
    single = {**SINGLE_DEVICE, "data.micro_batch_size": 1}  # (auto included)
    return setup_from_config(with_keys(cfg, single), device="cuda", world_size=1).args


SINGLE_DEVICE = {"parallel.dp_shard": 1, "parallel.dp_replicate": 1, "parallel.tp": 1,
                 "parallel.pp": 1, "parallel.cp": 1, "parallel.ep": 1,
                 "parallel.pp_schedule": "1f1b", "parallel.pp_virtual_stages": 1,
                 "data.global_batch_size": None}
QLORA = {"lora.enabled": True, "lora.quantize": "nf4", **SINGLE_DEVICE,
         "data.micro_batch_size": 1, "train.activation_checkpointing": "full"}


# ---------------------------------------------------------------- when nothing fits

def peak_gib(cfg: JobConfig, keys: dict, gpus: int, device: str = "cuda") -> Optional[float]:
    """Estimated total GiB of ``cfg`` with ``keys`` set on ``gpus`` devices of type
    ``device`` (cuda | cpu); None when the trainer would refuse that config."""
    try:
        setup = setup_from_config(with_keys(cfg, keys), device=device, world_size=gpus)
    except ConfigError:
        return None
    return estimate_memory(setup).total_bytes / GiB


def fits_on(cfg: JobConfig, gpus: int, per_node: int, device: Device) -> bool:
    """Whether any mesh fits at its leanest (ZeRO-3, full checkpointing, micro-batch 1,
    chunked loss where allowed): the cheap test for "how many GPUs would do"."""
    args = plan_args(cfg)
    lean = {"parallel.zero": 3, "train.activation_checkpointing": "full",
            "data.micro_batch_size": 1, "data.global_batch_size": None,
            "parallel.pp_schedule": "1f1b", "parallel.pp_virtual_stages": 1}
    for mesh in meshes(args, gpus, per_node, cfg.data.seq_len):
        plain = mesh["parallel.tp"] == 1 and mesh["parallel.pp"] == 1
        keys = {**mesh, **lean, "train.loss_chunk_tokens": LOSS_CHUNK_TOKENS if plain else 0}
        gib = peak_gib(cfg, keys, gpus)
        if gib is not None and gib <= budget_gib(device):
            return True
    return False


def gpus_needed(cfg: JobConfig, gpus: int, per_node: int, device: Device) -> Optional[int]:
    """The fewest GPUs, doubling from ``gpus``, on which some layout fits; None past
    MAX_GPUS."""
    n = gpus * 2
    while n <= MAX_GPUS:
        if fits_on(cfg, n, per_node, device):
            return n
        n *= 2
    return None


def qlora_fits(cfg: JobConfig, device: Device) -> bool:
    """Whether the model fine-tuned with QLoRA (nf4 base, one GPU) fits."""
    if cfg.lora.quantize:
        return False
    gib = peak_gib(cfg, QLORA, 1)
    return gib is not None and gib <= budget_gib(device)


def no_fit_message(cfg: JobConfig, gpus: int, per_node: int, device: Device,
                   name: str) -> str:
    """One line naming what to change when no layout fits."""
    options = []
    needed = gpus_needed(cfg, gpus, per_node, device)
    if needed is not None:
        options.append(f"--gpus >= {needed} of {name} ({device.memory_gib:g} GiB)")
    if qlora_fits(cfg, device):
        options.append("lora.enabled=true lora.quantize=nf4 (QLoRA fits one GPU)")
    advice = " or ".join(options) or "a device with more memory"
    return (f"--gpus: no layout fits {gpus} x {name} ({budget_gib(device):.1f} GiB usable "
            f"after a {MEMORY_MARGIN:.0%} margin); needs {advice}")


# ------------------------------------------------------- what makes an estimate fit

def single_changes(cfg: JobConfig, gpus: int) -> Iterator[tuple[str, dict, int]]:
    """(what to write, keys, devices) for each one-step change that lowers memory, the
    cheapest in throughput first."""
    p = cfg.parallel
    if p.zero == 2 and (p.dp_shard == -1 and gpus > 1 or p.dp_shard > 1):
        yield "parallel.zero=3", {"parallel.zero": 3}, gpus
    if not cfg.train.loss_chunk_tokens and p.tp == 1 and p.pp == 1:
        yield (f"train.loss_chunk_tokens={LOSS_CHUNK_TOKENS}",
               {"train.loss_chunk_tokens": LOSS_CHUNK_TOKENS}, gpus)
    if cfg.train.activation_checkpointing != "full":
        yield "train.activation_checkpointing=full", {"train.activation_checkpointing":
                                                       "full"}, gpus
    for text, keys in rollout_changes(cfg):  # GRPO: a smaller group, a shorter completion
        yield text, keys, gpus
    for mb in reversed(divisors(cfg.data.micro_batch_size)[:-1]):
        yield f"data.micro_batch_size={mb}", {"data.micro_batch_size": mb}, gpus
    n = gpus * 2
    while n <= min(MAX_GPUS, gpus * 64):
        yield f"--world-size {n} (parallel.dp_shard=-1)", {"parallel.dp_shard": -1}, n
        n *= 2
    if not cfg.lora.quantize:
        yield "lora.enabled=true lora.quantize=nf4 (QLoRA, one GPU)", QLORA, 1


def fixes(cfg: JobConfig, gpus: int, memory_gib: float, limit: int = 4) -> list[str]:
    """The first ``limit`` single changes after which the estimate fits ``memory_gib``
    (smaller micro-batches and more devices: only the least of each that fits)."""
    out, kinds = [], set()
    for text, keys, n in single_changes(cfg, gpus):
        kind = text.split("=")[0].split(" ")[0]
        if kind in kinds:
            continue
        gib = peak_gib(cfg, keys, n)
        if gib is not None and gib <= memory_gib:
            out.append(f"{text} ({gib:.1f} GiB)")
            kinds.add(kind)
        if len(out) == limit:
            break
    return out
