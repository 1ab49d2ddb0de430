"""An analytical step time for one layout (docs/plan.md writes the model down): compute at
a fraction of the device's peak, recomputation, the communication that cannot hide behind
compute, and the pipeline bubble. Nothing here runs a kernel; the numbers are predictions
to rank layouts, uncalibrated unless the efficiency factor is changed.

The device and link constants live in ``DEVICES`` and nowhere else; the bf16 peak is read
from ``flops.PEAK_BF16_TFLOPS`` by the part's name, so that fact stays in one place."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from lmforge.perf.estimate_setup import Setup, compute_bytes
from lmforge.perf.flops import flops_breakdown, match_peak_tflops, matmul_params
from lmforge.models.registry import family_of
from lmforge.perf.masks import dense_masks
from lmforge.perf.moe_walk import arrived_share


@dataclass(frozen=True)
class Link:
    """Alpha-beta model of one link: ``latency_us`` per message step, ``gb_per_s`` the
    bandwidth one GPU can send in one direction (GB = 1e9 bytes)."""
    gb_per_s: float
    latency_us: float

    def seconds(self, nbytes: float, steps: int = 1) -> float:
        return steps * self.latency_us * 1e-6 + nbytes / (self.gb_per_s * 1e9)


@dataclass(frozen=True)
class Device:
    part: str  # matched against flops.PEAK_BF16_TFLOPS, which holds the bf16 peak
    memory_gib: float
    intra: Link  # inside a node (NVLink / PCIe)
    inter: Link  # between nodes (InfiniBand / RoCE), per GPU
    efficiency: float  # the fraction of peak the model's FLOPs run at
    peak_tflops: Optional[float] = None  # set: this, not flops.PEAK_BF16_TFLOPS
    calibrated: bool = True  # False: reference units only, --calibrate supplies the rates
    # Fixed microseconds per block and pass (forward, backward, recomputed forward) of a
    # micro-batch: kernel launches, framework dispatch and hooks, which no FLOP rate
    # captures. 0 for the GPUs (at the sizes they are quoted for it is a few percent of a
    # block's time and the efficiency absorbs it); --calibrate fits it.
    block_pass_us: float = 0.0
    # Whether collectives run beside compute (a GPU: NCCL on its own streams and SMs) or
    # take turns with it (a CPU: gloo's threads run on the cores that compute).
    overlaps_communication: bool = True

    @property
    def peak_flops(self) -> float:
        return (self.peak_tflops or match_peak_tflops(self.part)) * 1e12


# Sources (vendor data sheets): H100 SXM5: 80 GB HBM3, NVLink 900 GB/s (bidirectional, so
# 450 one way); DGX H100: one 400 Gb/s ConnectX-7 per GPU = 50 GB/s. H200 SXM: 141 GB
# HBM3e, same NVLink and network. A100 SXM4 80GB/40GB: NVLink 600 GB/s (300 one way);
# DGX A100: one 200 Gb/s HDR InfiniBand per GPU = 25 GB/s. L40S: 48 GB GDDR6, no NVLink,
# PCIe Gen4 x16 64 GB/s (32 one way); its 200 Gb/s network per GPU is an assumption.
# Latencies are not on any sheet: 5 us for an NVLink ring step and 10 us across nodes are
# typical NCCL small-message figures, stated here as assumptions.
# Efficiency (fraction of peak reached by the model's matmuls and attention, eager bf16):
# a prior, not fitted per configuration: ~0.5 on A100 (Megatron-LM and torchtitan report
# 50-60% MFU there), ~0.4 on H100/H200 (torchtitan states 33-39% MFU for Llama 3.1 8B
# FSDP on H100), 0.4 on L40S for want of a published figure.
DEVICES: dict[str, Device] = {
    "h100": Device("H100 SXM5", 80.0, Link(450.0, 5.0), Link(50.0, 10.0), 0.40),
    "h200": Device("H200", 141.0, Link(450.0, 5.0), Link(50.0, 10.0), 0.40),
    "a100-80g": Device("A100", 80.0, Link(300.0, 5.0), Link(25.0, 10.0), 0.50),
    "a100-40g": Device("A100", 40.0, Link(300.0, 5.0), Link(25.0, 10.0), 0.50),
    "l40s": Device("L40S", 48.0, Link(32.0, 5.0), Link(25.0, 10.0), 0.40),
    # A CPU's sustained FLOP rate and its gloo transport are not on a data sheet (they
    # depend on the part, threads, the BLAS and the load), so no honest prior exists: the
    # entry holds reference units (1 TFLOP/s at efficiency 1, 1 GB/s) that only
    # split a step into its terms (1 us of latency and of overhead per block pass), and
    # `lmforge plan --device cpu` requires --calibrate or
    # --calibration, which replace them with the rates fitted on this machine. Memory: the
    # machine's RAM, read at plan time (0 here).
    "cpu": Device("cpu", 0.0, Link(1.0, 1.0), Link(1.0, 1.0), 1.0, peak_tflops=1.0,
                  calibrated=False, block_pass_us=1.0, overlaps_communication=False),
}

GRAD_REDUCE_BYTES = 4  # FSDP2 reduces gradients in fp32 (parallel/fsdp.py reduce_dtype)


# ------------------------------------------------------------------ collectives

def ring(kind: str, nbytes: float, n: int, link: Link) -> float:
    """Seconds of a ring collective over ``n`` ranks on a buffer of ``nbytes`` (the whole,
    unsharded size): all-gather and reduce-scatter move (n-1)/n of it, all-reduce twice."""
    if n <= 1:
        return 0.0
    steps = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2}[kind]
    return link.seconds(steps * nbytes * (n - 1) / n, steps * (n - 1))


def group_link(device: Device, span: int, gpus_per_node: int) -> Link:
    """A group of consecutive ranks ``span`` wide crosses nodes when it is wider than a
    node; a collective is as slow as its slowest link, so it then runs at the inter-node
    link. The mesh is (pp, dp_replicate, dp_shard, cp, tp), tp innermost."""
    return device.intra if span <= gpus_per_node else device.inter


# ------------------------------------------------------------------ the step

@dataclass
class StepTime:
    compute: float  # model FLOPs at the efficiency factor
    recompute: float  # activation checkpointing and chunked-loss recomputation
    tp_comm: float  # exposed: tensor-parallel collectives are on the critical path
    cp_comm: float  # exposed: context parallelism's k/v gathers and their gradients
    dp_comm: float  # exposed part of FSDP / replicate collectives
    pp_comm: float  # exposed: stage-to-stage sends
    bubble: float  # pipeline fill and drain
    overhead: float  # fixed costs per block pass (Device.block_pass_us)
    model_flops: float  # per device per step
    tokens: float  # per device per step (global tokens / devices)
    peak_flops: float
    ep_comm: float = 0.0  # exposed: expert parallelism's all-to-alls

    @property
    def total(self) -> float:
        return (self.compute + self.recompute + self.tp_comm + self.cp_comm + self.dp_comm
                + self.pp_comm + self.ep_comm + self.bubble + self.overhead)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.total

    @property
    def mfu(self) -> float:
        return self.model_flops / self.total / self.peak_flops

    @property
    def largest(self) -> str:
        terms = {"compute": self.compute, "recomputation": self.recompute,
                 "exposed communication": (self.tp_comm + self.cp_comm + self.dp_comm
                                           + self.pp_comm + self.ep_comm),
                 "pipeline bubble": self.bubble, "per-pass overhead": self.overhead}
        return max(terms, key=terms.get)


def recompute_fraction(setup: Setup) -> float:
    """Share of one forward of the blocks run again in backward: the checkpointed blocks'
    (all of them under full; under selective the trainer's every n-th, so 2 of 3 blocks
    with every=2)."""
    n = setup.args.n_layers
    return sum(setup.checkpointed(i) for i in range(n)) / n


def flops_per_token(setup: Setup) -> tuple[float, float]:
    """(model FLOPs, FLOPs run beyond them) per token. Beyond: the fraction of the blocks'
    forward checkpointing repeats, the head's forward under a chunked loss, and the
    scores a dense mask hides: a masked SDPA computes every query's scores against every
    key (a causal one skips the half no query sees), so the masked layers' attention
    costs twice the causal count (perf/masks.py says which layers)."""
    fl = flops_breakdown(setup.args, setup.batch.seq_len, setup.trainable)
    head = 2 * setup.args.dim * setup.args.vocab_size
    blocks_forward = fl.forward + fl.attention_forward - head
    extra = recompute_fraction(setup) * blocks_forward
    if setup.cfg.train.loss_chunk_tokens:
        extra += head
    share = dense_masks(setup).share
    if share:
        full = flops_breakdown(setup.args, setup.batch.seq_len, setup.trainable, causal=False)
        attention = full.attention_forward + full.attention_backward
        extra += share * (attention - fl.attention_forward - fl.attention_backward)
    return fl.total, extra


def param_count(args, ep: int = 1) -> float:
    """Weights FSDP gathers over dp_shard: the matmul weights (every expert of an MoE,
    none of them under expert parallelism: ``expert_dp_seconds`` has those) and the
    embedding (norms are negligible)."""
    return (matmul_params(args, active=False) + args.dim * args.vocab_size
            - (routed_expert_params(args) if ep > 1 else 0))


def routed_expert_params(args) -> float:
    """The stacked experts' weights of every MoE layer (0 for a dense model)."""
    block = family_of(args).block(args)
    moe = block.moe
    if moe is None:
        return 0.0
    return len(block.sparse_layers or ()) * moe.n_experts * 3 * moe.dim * moe.ffn_dim


def ep_seconds(setup: Setup, device: Device, gpus_per_node: int) -> float:
    """Expert parallelism's all-to-alls, all exposed (the experts wait for their rows, the
    combine for the experts): per MoE layer and micro-batch the forward sends each token's
    top_k rows out and their outputs back (micro-batch x seq x top_k x dim, compute
    dtype, each way; (ep-1)/ep of them leave the rank), the backward the same two
    reversed, a checkpointed layer's recomputation the forward's again; each at the
    busiest rank's share (``moe_walk.EP_IMBALANCE``)."""
    ep = setup.ep
    block = family_of(setup.args).block(setup.args)
    if ep == 1 or block.moe is None:
        return 0.0
    moe = block.moe
    # (the ep ranks: consecutive within dp_shard, tp ranks apart, as torchtitan's
    # dp_shard_in_ep; the experts' FSDP group strides over them)
    link = group_link(device, ep * setup.layout.tp, gpus_per_node)
    rows = setup.tokens * moe.top_k * arrived_share(setup, moe)
    one = link.seconds(rows * moe.dim * compute_bytes(setup) * (ep - 1) / ep, ep - 1)
    sparse = len(block.sparse_layers or ())
    return 2 * one * (2 + recompute_fraction(setup)) * sparse * setup.batch.microbatches


def step_time(setup: Setup, device: Device, gpus_per_node: int) -> StepTime:
    """Predicted seconds of one optimizer step of ``setup`` on ``device``."""
    m = setup.batch.microbatches
    seq_tokens = setup.micro_batch * setup.batch.seq_len * m  # per data-parallel replica
    model, extra = flops_per_token(setup)
    split = setup.layout.tp * setup.layout.pp * setup.layout.cp
    rate = device.peak_flops * device.efficiency
    compute, recompute = model * seq_tokens / split / rate, extra * seq_tokens / split / rate
    virtual = setup.cfg.parallel.pp_virtual_stages
    bubble = (compute + recompute) * (setup.layout.pp - 1) / (m * virtual)
    tp = tp_seconds(setup, device, gpus_per_node)
    cp = cp_seconds(setup, device, gpus_per_node)
    dp = dp_seconds(setup, device, gpus_per_node, compute + recompute)
    pp = pp_seconds(setup, device, gpus_per_node)
    overhead = block_passes(setup) * device.block_pass_us * 1e-6
    return StepTime(compute=compute, recompute=recompute, tp_comm=tp, cp_comm=cp, dp_comm=dp,
                    pp_comm=pp,
                    bubble=bubble, overhead=overhead, model_flops=model * seq_tokens / split,
                    tokens=seq_tokens / split, peak_flops=device.peak_flops,
                    ep_comm=ep_seconds(setup, device, gpus_per_node))


def block_passes(setup: Setup) -> float:
    """Block passes one device runs per step: each of its blocks, for each micro-batch,
    forward, backward and the recomputed share of the forward."""
    blocks = setup.args.n_layers / setup.layout.pp
    return setup.batch.microbatches * blocks * (2 + recompute_fraction(setup))


def activation_bytes(setup: Setup) -> float:
    """One micro-batch's residual stream on one cp rank, unsharded: b x s / cp x dim x C."""
    return setup.tokens * setup.args.dim * compute_bytes(setup)


def cp_seconds(setup: Setup, device: Device, gpus_per_node: int) -> float:
    """Context parallelism, all exposed (attention waits for its keys): per block and
    micro-batch, the forward all-gathers k and v over the cp group (the whole sequence's,
    this tp rank's kv heads), the recomputed forward again, and backward reduce-scatters
    their gradients. The cp group sits inside the tp group's stride: tp x cp ranks wide."""
    cp = setup.layout.cp
    if cp == 1:
        return 0.0
    args = setup.args
    link = group_link(device, setup.layout.tp * cp, gpus_per_node)
    kv = (setup.micro_batch * setup.batch.seq_len * args.n_kv_heads * args.head_dim
          * compute_bytes(setup) / setup.layout.tp)  # k or v, gathered
    gather = 2 * ring("all_gather", kv, cp, link)
    reduce = 2 * ring("reduce_scatter", kv, cp, link)
    blocks = args.n_layers / setup.layout.pp
    return (gather * (1 + recompute_fraction(setup)) + reduce) * blocks * setup.batch.microbatches


def tp_seconds(setup: Setup, device: Device, gpus_per_node: int) -> float:
    """Tensor parallelism, all exposed: per block forward, attention and MLP each gather
    their input and reduce-scatter their output (sequence parallel) or all-reduce it (not);
    backward does the same again, and recomputation repeats the forward's."""
    if setup.layout.tp == 1:
        return 0.0
    link = group_link(device, setup.layout.tp, gpus_per_node)
    act = activation_bytes(setup)
    tp = setup.layout.tp
    if setup.cfg.parallel.sequence_parallel:
        pair = ring("all_gather", act, tp, link) + ring("reduce_scatter", act, tp, link)
    else:
        pair = ring("all_reduce", act, tp, link)
    passes = 2 + recompute_fraction(setup)  # forward, backward, recomputed forward
    blocks = setup.args.n_layers / setup.layout.pp
    return 2 * pair * passes * blocks * setup.batch.microbatches


def dp_seconds(setup: Setup, device: Device, gpus_per_node: int, compute: float) -> float:
    """Exposed FSDP / replicate communication. Per micro-batch (the trainer syncs every
    one): ZeRO-3 gathers the parameters in forward and again in backward, ZeRO-2 once;
    gradients are reduce-scattered over dp_shard x cp (fp32) and all-reduced over
    dp_replicate.
    All of it overlaps compute except each micro-batch's first block all-gather and last
    block reduce (nothing to hide behind), and whatever exceeds the compute time; on a
    device that does not overlap communication, all of it is exposed."""
    layout = setup.layout
    shard = layout.fsdp_shard
    if shard * layout.dp_replicate == 1:
        return 0.0
    params = param_count(setup.args, setup.ep) / (setup.layout.tp * setup.layout.pp)
    trains = 0.0 if setup.lora is not None else params  # adapters are negligible
    shard_link = group_link(device, layout.tp * shard, gpus_per_node)
    rep_link = group_link(device, layout.tp * shard * layout.dp_replicate, gpus_per_node)
    gathers = 2 if setup.cfg.parallel.zero == 3 else 1
    gather = ring("all_gather", params * compute_bytes(setup), shard, shard_link)
    reduce = ring("reduce_scatter", trains * GRAD_REDUCE_BYTES, shard, shard_link)
    replicate = ring("all_reduce", trains * GRAD_REDUCE_BYTES / shard, layout.dp_replicate,
                     rep_link)
    e_gather, e_reduce, e_replicate = expert_dp_seconds(setup, device, gpus_per_node)
    gather, reduce, replicate = gather + e_gather, reduce + e_reduce, replicate + e_replicate
    per_micro = gathers * gather + reduce + replicate
    blocks = setup.args.n_layers / setup.layout.pp
    unhidden = (gather + reduce + replicate) / blocks  # the first gather, the last reduce
    m = setup.batch.microbatches
    if not device.overlaps_communication:
        return m * per_micro
    return max(0.0, m * per_micro - compute) + m * unhidden


def expert_dp_seconds(setup: Setup, device: Device,
                      gpus_per_node: int) -> tuple[float, float, float]:
    """(gather, reduce-scatter, all-reduce) seconds of the routed experts under expert
    parallelism, which ``dp_seconds``' FSDP traffic leaves out: each rank's n_experts / ep
    experts gathered over dp_shard / ep ranks and their gradients reduce-scattered there
    (none at ep = dp_shard), then all-reduced over dp_replicate (1 / dp_shard of them)."""
    layout = setup.layout
    if setup.ep == 1:
        return 0.0, 0.0, 0.0
    local = routed_expert_params(setup.args) / setup.ep
    trains = 0.0 if setup.lora is not None else local  # adapters are negligible
    es = setup.expert_shard
    link = group_link(device, layout.tp * layout.fsdp_shard, gpus_per_node)
    rep_link = group_link(device, layout.tp * layout.fsdp_shard * layout.dp_replicate,
                          gpus_per_node)
    return (ring("all_gather", local * compute_bytes(setup), es, link),
            ring("reduce_scatter", trains * GRAD_REDUCE_BYTES, es, link),
            ring("all_reduce", trains * GRAD_REDUCE_BYTES / es, layout.dp_replicate,
                 rep_link))


def pp_seconds(setup: Setup, device: Device, gpus_per_node: int) -> float:
    """Pipeline sends, exposed: each micro-batch crosses every stage boundary of this rank
    once forward (activations) and once backward (their gradients); with sequence
    parallelism each TP rank sends its 1/tp slice."""
    if setup.layout.pp == 1:
        return 0.0
    link = device.inter if setup.layout.world_size > gpus_per_node else device.intra
    p = setup.cfg.parallel
    per_send = activation_bytes(setup) / (setup.layout.tp if p.sequence_parallel else 1)
    return 2 * setup.batch.microbatches * p.pp_virtual_stages * link.seconds(per_send)


def known_device(name: str) -> Device:
    """The device called ``name``; a ValueError naming the known ones otherwise."""
    found: Optional[Device] = DEVICES.get(name)
    if found is None:
        raise ValueError(f"--device: unknown device {name!r} (known: {', '.join(DEVICES)})")
    return found
