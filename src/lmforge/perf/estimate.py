"""Peak memory per device for a config, before anything runs (``lmforge estimate``).

The model (docs/estimate.md derives every term) follows what autograd keeps alive in our
models: which tensors each op saves for backward, given which inputs require gradients and
which weights train, in the dtypes the run uses: Korthikanti et al.'s (2022) activation
analysis for the blocks the family describes (``models.family.BlockSpec``), evaluated
where a step's memory peaks ("Phases and the peak").

This module holds the terms of docs/estimate.md by name (weights, gradients, optimizer
states, activations, loss head, autocast copies, FSDP transients, dequantization scratch,
optimizer temporaries, framework overhead); ``phases`` adds them up where a step may
peak; ``weights`` and ``activations`` make the terms. The same formulas serve GPU and CPU (but for the
framework overhead); ``perf.tracker.TensorMemoryTracker`` measures the same quantity on a
real step (tests/unit/perf/test_estimate_measured.py).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from lmforge.perf.activations import Activations, activation_model
from lmforge.perf.estimate_setup import Setup, frozen_weight_dtype
from lmforge.perf.phases import stage_terms, step_in_backward_phases, step_phases
from lmforge.perf.rollout import (ROLLOUT, decode_state_bytes, describe_rollout,  # noqa: F401
                                  kv_cache_bytes_per_token, rollout_terms)
from lmforge.models.registry import family_of
from lmforge.perf.weights import (Weights, active_parameters, fsdp_share, model_parameters,
                                  stage_weights)

GiB = 2**30
# Optimizer states per trainable parameter (count, stored in the parameter's dtype).
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 1, "lion": 1, "adamw_bf16": 2}
# adamw_bf16 (train/low_memory.py) keeps its moments in bf16; the others in fp32.
STATE_BYTES = {"adamw_bf16": 2}
# Not tensors: what a device needs beyond the allocator's peak allocated bytes.
CUDA_CONTEXT_GIB = 0.6  # CUDA context, kernels, cuBLAS workspaces (0.3-1 GiB in practice)
CUDA_ALLOCATOR_SLACK = 0.10  # reserved - allocated (fragmentation of the caching allocator)
NCCL_BUFFERS_GIB = 0.5  # communicators and their buffers, with more than one device
CPU_PROCESS_GIB = 0.3  # Python, torch, lmforge (0.22 GiB measured after import) + data


# ------------------------------------------------- static terms: weights, optimizer states

def static_terms(setup: Setup, weights: Weights) -> dict[str, float]:
    """What every phase holds (the steady state, from step 2 on). FSDP2 (zero 2 and 3
    alike) shards parameters and optimizer state over dp_shard (x cp)."""
    shard, es = setup.layout.fsdp_shard, setup.expert_shard
    terms = {"weights (trainable)": fsdp_share(weights.trainable_bytes,
                                               weights.ep_trainable_bytes, shard, es),
             "weights (frozen base)": fsdp_share(weights.frozen_bytes,
                                                 weights.ep_frozen_bytes, shard, es),
             "optimizer states": optimizer_state_bytes(setup, weights)}
    if setup.reference == "copy":  # DPO/IPO's frozen reference, stored and sharded alike
        terms["weights (reference copy)"] = (terms["weights (trainable)"]
                                             + terms["weights (frozen base)"])
    return terms


def optimizer_state_bytes(setup: Setup, weights: Weights) -> float:
    """AdamW: exp_avg and exp_avg_sq per trainable parameter (fp32; bf16 for
    adamw_bf16); SGD with momentum and Lion: one state."""
    n_states = OPTIMIZER_STATES.get(setup.cfg.optim.name)
    if n_states is None:
        raise ValueError(f"optim.name: no memory model for {setup.cfg.optim.name!r} "
                         f"(known: {', '.join(OPTIMIZER_STATES)})")
    state_bytes = STATE_BYTES.get(setup.cfg.optim.name, 4)
    return state_bytes * n_states * fsdp_share(weights.trainable_params,
                                               weights.ep_trainable_params,
                                               setup.layout.fsdp_shard, setup.expert_shard)


def framework_overhead(setup: Setup, peak: float) -> dict[str, float]:
    """Not tensors: the CUDA context and workspaces, the caching allocator's slack, NCCL
    buffers with more than one device; on the CPU the Python process."""
    if setup.device == "cuda":
        out = {"CUDA context and workspaces": CUDA_CONTEXT_GIB * GiB,
               "caching-allocator slack (10%)": CUDA_ALLOCATOR_SLACK * peak}
        if setup.layout.world_size > 1:
            out["NCCL buffers"] = NCCL_BUFFERS_GIB * GiB
        return out
    return {"Python process (interpreter, libraries)": CPU_PROCESS_GIB * GiB}


# ---------------------------------------------------------------------------- estimate

@dataclass
class MemoryEstimate:
    setup: Setup
    stage: int
    phase: str  # where the peak falls
    components: dict  # name -> bytes at the peak; they sum to peak_bytes
    phases: dict  # phase -> bytes
    overhead: dict  # name -> bytes, not tensors
    activations: Activations
    host_bytes: float = 0.0  # offloaded activations in pinned host memory (not on device)
    rollout: dict = dataclasses.field(default_factory=dict)  # GRPO: the rollout's terms

    @property
    def peak_bytes(self) -> float:
        return sum(self.components.values())

    @property
    def overhead_bytes(self) -> float:
        return sum(self.overhead.values())

    @property
    def total_bytes(self) -> float:
        return self.peak_bytes + self.overhead_bytes

    def as_dict(self) -> dict:
        s = self.setup
        t, p, layout = s.cfg.train, s.cfg.parallel, s.layout
        return {
            "model": describe_model(s.args),
            "parameters": model_parameters(s.args),
            "active_parameters": active_parameters(s.args),
            "setup": {"seq_len": s.batch.seq_len, "micro_batch": s.micro_batch,
                      "device": s.device, "compute": s.compute,
                      "checkpointing": t.activation_checkpointing,
                      "checkpoint_every": t.activation_checkpointing_every,
                      "optimizer": s.cfg.optim.name,
                      "lora": dataclasses.asdict(s.lora) if s.lora else None,
                      "tp": layout.tp, "pp": layout.pp, "dp_shard": layout.dp_shard,
                      "cp": layout.cp, "ep": s.ep,
                      "dp_replicate": layout.dp_replicate, "zero": p.zero,
                      "sequence_parallel": p.sequence_parallel, "attention": s.attention,
                      "microbatches": s.batch.microbatches},
            "notes": list(s.notes),
            "pipeline_stage": self.stage,
            "peak_phase": self.phase,
            "components_gib": {k: v / GiB for k, v in self.components.items()},
            "phases_gib": {k: v / GiB for k, v in self.phases.items()},
            "peak_allocated_gib": self.peak_bytes / GiB,
            "overhead_gib": {k: v / GiB for k, v in self.overhead.items()},
            "total_gib": self.total_bytes / GiB,
            "host_offloaded_gib": self.host_bytes / GiB,
            "kv_cache_bytes_per_token_per_row": kv_cache_bytes_per_token(s),
            "rollout_gib": {k: v / GiB for k, v in self.rollout.items()},
        }


def describe_model(args) -> str:
    """One line; an MoE's names its active parameters (docs/estimate.md, "Mixture of
    experts") and its experts."""
    moe = family_of(args).block(args).moe
    total = f"{model_parameters(args):,} parameters"
    if moe is not None:
        total += (f" ({active_parameters(args):,} active: top {moe.top_k} of "
                  f"{moe.n_experts} experts of ffn {moe.ffn_dim}"
                  + (f", {moe.n_shared_experts} shared" if moe.n_shared_experts else "") + ")")
    return (f"{args.family}, {total}, dim {args.dim}, "
            f"{args.n_layers} layers, {args.n_heads}/{args.n_kv_heads} heads, "
            f"ffn {args.ffn_dim}, vocab {args.vocab_size}")


def estimate_stage(setup: Setup, stage: int) -> MemoryEstimate:
    """Pipeline stage ``stage`` on one device: the static terms plus the phase where the
    sum peaks, its components, and the framework overhead on top."""
    weights = stage_weights(setup, stage)
    static = static_terms(setup, weights)
    act = activation_model(setup)
    terms = stage_terms(setup, weights, act, stage)
    phases = step_phases(terms)
    if setup.cfg.optim.in_backward:
        step_in_backward_phases(setup, phases)
    if terms.activations.idle_forward:  # (a linear layer before anything trains)
        phases["forward: a layer saving nothing"] = {"gradients": terms.gradients.accumulated,
                                                     "activations": terms.tokens
                                                     * terms.activations.idle_forward}
    rollout = rollout_terms(setup)
    if rollout:  # GRPO: before the step's forward, gradients freed (set_to_none)
        phases[ROLLOUT] = rollout
    totals = {name: sum(static.values()) + sum(parts.values()) for name, parts in phases.items()}
    peak_phase = max(totals, key=totals.get)
    components = {k: v for k, v in {**static, **phases[peak_phase]}.items() if v}
    return MemoryEstimate(setup=setup, stage=stage, phase=peak_phase, components=components,
                          phases=totals,
                          overhead=framework_overhead(setup, sum(components.values())),
                          activations=act, host_bytes=terms.activations.host * terms.tokens,
                          rollout=rollout)


def estimate_memory(setup: Setup) -> MemoryEstimate:
    """The peak over pipeline stages (the first holds the most activations, the last the
    loss head); with pp=1 the one stage."""
    stages = {0, setup.layout.pp - 1}
    return max((estimate_stage(setup, st) for st in sorted(stages)),
               key=lambda e: e.total_bytes)


def max_micro_batch(setup: Setup, device_memory_gib: float, limit: int = 1 << 16) -> int:
    """The largest micro-batch whose estimated total fits ``device_memory_gib``; 0 if even
    one sequence does not."""
    budget = device_memory_gib * GiB

    def fits(b: int) -> bool:
        trial = dataclasses.replace(setup, micro_batch_override=b)
        return estimate_memory(trial).total_bytes <= budget

    return largest_fitting(range(1, limit + 1), fits) or 0


def largest_fitting(candidates: Sequence[int], fits: Callable[[int], bool]) -> Optional[int]:
    """The largest of ``candidates`` (ascending) that ``fits``, None if none does; ``fits``
    must hold for every candidate below one it holds for (the estimate grows with the
    micro-batch), so a binary search suffices."""
    lo, hi = -1, len(candidates)  # candidates[lo] fits, candidates[hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(candidates[mid]) else (lo, mid)
    return candidates[lo] if lo >= 0 else None


def format_table(est: MemoryEstimate, device_memory_gib: Optional[float] = None,
                 fit: Optional[int] = None) -> str:
    s = est.setup
    lora = "full training"
    if s.lora is not None:
        targets = ",".join(name for name, _ in s.trainable.adapters)  # (the model's own)
        lora = (f"LoRA r{s.lora.rank} on {targets}, base "
                f"{s.lora.quantize or frozen_weight_dtype(s)}")
    t, layout = s.cfg.train, s.layout
    every = t.activation_checkpointing_every
    lines = [
        f"model: {describe_model(s.args)}",
        f"run: seq {s.batch.seq_len} x micro-batch {s.micro_batch}"
        + (f" ({s.micro_batch // 2} pair{'s' if s.micro_batch != 2 else ''})"
           if s.cfg.data.kind == "preference" else
           f" ({s.micro_batch // s.batch.sequences_per_sample} prompts x "
           f"{s.batch.sequences_per_sample} completions)" if s.cfg.data.kind == "prompts"
           else "")
        + f", {s.compute} compute, "
        f"{lora}, {s.cfg.optim.name}, checkpointing {t.activation_checkpointing}"
        + (f" (every {every})" if t.activation_checkpointing == "selective" else "")
        + f", attention {s.attention}",
        f"layout: {layout.world_size} device(s) on {s.device}: dp_replicate "
        f"{layout.dp_replicate} x dp_shard {layout.dp_shard} x cp {layout.cp} x tp "
        f"{layout.tp} x pp {layout.pp}, zero {s.cfg.parallel.zero}"
        + (f"; ep {s.ep}: {s.args.n_experts // s.ep} experts per layer on each rank, "
           + (f"FSDP-sharded over {s.expert_shard}" if s.expert_shard > 1 else "whole")
           if s.ep > 1 else "")
        + (f"; pipeline stage {est.stage}" if layout.pp > 1 else ""),
        "",
        f"{'per device':46s}{'GiB':>10s}",
    ]
    for name, value in est.components.items():
        lines.append(f"  {name:44s}{value / GiB:10.3f}")
    lines.append(f"  {'peak allocated (' + est.phase + ')':44s}{est.peak_bytes / GiB:10.3f}")
    for name, value in est.overhead.items():
        lines.append(f"  {name:44s}{value / GiB:10.3f}")
    lines.append(f"  {'total':44s}{est.total_bytes / GiB:10.3f}")
    if t.activation_offload:
        lines.append(f"host (pinned): offloaded activations {est.host_bytes / GiB:.3f} GiB")
    per_token = kv_cache_bytes_per_token(s)
    lines.append(f"generation: the KV cache holds {per_token / 1024:.1f} KiB per token per row "
                 f"({s.cfg.train.param_dtype}); {s.micro_batch} rows x {s.batch.seq_len} "
                 f"tokens: {per_token * s.micro_batch * s.batch.seq_len / GiB:.3f} GiB"
                 + (f"; linear-attention layers: a state of {state / 2**20:.2f} MiB per row, "
                    "whatever its length" if (state := decode_state_bytes(s)) else ""))
    if est.rollout:
        lines.append(describe_rollout(s, est.rollout, est.phases[ROLLOUT], est.phase))
    for note in s.notes:
        lines.append(f"note: {note}")
    if device_memory_gib is not None:
        verdict = "fits" if est.total_bytes <= device_memory_gib * GiB else "does NOT fit"
        lines.append("")
        lines.append(f"{verdict} in {device_memory_gib:g} GiB; largest micro-batch that fits: "
                     f"{fit}")
    return "\n".join(lines)
