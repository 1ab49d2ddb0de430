"""The phases of a training step where memory may peak (docs/estimate.md, "Phases and the
peak"): each a sum of the terms ``perf.estimate`` names (weights, gradients, optimizer
states, activations, the loss head, transients), for one pipeline stage
(``StageTerms``); ``estimate`` takes the largest."""
from __future__ import annotations

from dataclasses import dataclass

from lmforge.perf.activations import (Activations, StageActivations, loss_chunk_tokens,
                                      stage_activations)
from lmforge.perf.buffers import (autocast_copies, dequantization_scratch, fsdp_buffers,
                                  optimizer_temporaries, stage_gradients)
from lmforge.perf.estimate_setup import DTYPE_BYTES, Setup
from lmforge.perf.weights import Weights, largest_trained_matrix, stage_layers

# optim.in_backward steps one parameter at a time. Bytes per element of the parameter
# being stepped, beside its gradient: AdamWBF16 holds both moments, the weight and the
# rounding noise in fp32 (16) and a rounding copy (fp32 bits and the bf16 result, 6); a
# torch optimizer stepped per parameter, about two fp32 temporaries.
IN_BACKWARD_STEP_BYTES = {"adamw_bf16": 22.0}
IN_BACKWARD_STEP_BYTES_DEFAULT = 8.0


@dataclass
class StageTerms:
    """The terms of one pipeline stage on one device that change over a step."""
    layers: int  # blocks on the stage
    tokens: int  # of the micro-batch
    loss_tokens: int  # whose logits exist at once
    activations: StageActivations  # per token
    gradients: Gradients
    copies: AutocastCopies
    fsdp: FsdpBuffers
    dequantization_scratch: float
    optimizer_temporaries: float
    reference_pass: bool = False  # a preference run's live reference forward
    # train.fused_loss with a trainable head: its fp32 weight gradient, made in the forward
    # pass by the summed loss (held until backward), in backward by the per-token one
    fused_head_gradient: float = 0.0
    fused_summed: bool = False  # the summed form (next-token objectives)


def stage_terms(setup: Setup, weights: Weights, act: Activations, stage: int) -> StageTerms:
    grads = stage_gradients(setup, weights, stage)
    return StageTerms(
        layers=stage_layers(setup, stage), tokens=setup.tokens,
        loss_tokens=loss_chunk_tokens(setup),
        activations=stage_activations(setup, act, stage),
        gradients=grads,
        copies=autocast_copies(setup, weights, stage),
        fsdp=fsdp_buffers(setup, weights, grads, stage),
        dequantization_scratch=dequantization_scratch(setup, weights),
        optimizer_temporaries=optimizer_temporaries(setup, weights),
        reference_pass=bool(setup.reference),
        fused_head_gradient=fused_head_gradient(setup),
        fused_summed=setup.job.objective == "next_token")


def fused_head_gradient(setup: Setup) -> float:
    """The fused loss's fp32 gradient of the whole output weight (models/fused_loss.py
    sums it over the chunks in fp32; tp, which would shard it, is refused with it)."""
    args = setup.args
    if not setup.cfg.train.fused_loss or not setup.trainable.head:
        return 0.0
    return 4.0 * args.vocab_size * args.dim


def step_phases(t: StageTerms) -> dict[str, dict[str, float]]:
    """Phase -> {term: bytes} at the points of a step where memory peaks (docs/estimate.md,
    "Phases and the peak"); the static terms come on top of each."""
    act, loss_tokens, grads = t.activations, t.loss_tokens, t.gradients
    head = loss_tokens * (act.logits + act.log_softmax + act.fp32_logits)
    return {
        "forward end": {
            "activations": t.tokens * act.at_forward_end,
            # DPO/IPO's no-grad reference pass runs after the policy's forward, which by
            # then keeps only its log-softmax for backward; the pass makes its own logits
            "loss head (logits, log-softmax)":
                loss_tokens * act.log_softmax if t.reference_pass else head,
            "reference pass (logits, log-softmax)": head if t.reference_pass else 0.0,
            "fused loss head gradient": t.fused_head_gradient if t.fused_summed else 0.0,
            "autocast weight copies": t.copies.at_forward_end,
            "gradients": grads.accumulated,
            "FSDP unsharded parameters": t.fsdp.params_outside_blocks},
        "backward: loss": {
            "activations": t.tokens * act.at_forward_end,
            # the log-softmax, its gradient and the logits' gradient (fp32 each)
            "loss head (logits, log-softmax)": loss_tokens * 3 * act.log_softmax,
            "fused loss head gradient": t.fused_head_gradient,
            "autocast weight copies": t.copies.at_backward_loss,
            "gradients": grads.accumulated,
            "FSDP unsharded parameters": t.fsdp.params_outside_blocks},
        "backward: last block": {
            "activations": t.tokens * act.at_last_block,
            "autocast weight copies": t.copies.at_last_block,
            "gradients": grads.in_block_backward(grads.before_blocks + grads.mlp_out),
            "backward buffers": t.tokens * act.backward_buffers,
            "dequantization scratch": t.dequantization_scratch,
            "FSDP unsharded parameters": t.fsdp.params_in_blocks,
            "FSDP gradient buffers": t.fsdp.gradients_last_block},
        "backward: first block": {
            "activations": t.tokens * act.at_first_block,
            "autocast weight copies": t.copies.at_first_block,
            "gradients": grads.in_block_backward(
                grads.before_blocks + (t.layers - 1) * grads.per_block + grads.mlp_out),
            "backward buffers": t.tokens * act.backward_buffers,
            "dequantization scratch": t.dequantization_scratch,
            "FSDP unsharded parameters": t.fsdp.params_in_blocks,
            "FSDP gradient buffers": t.fsdp.gradients_first_block},
        "optimizer step": {
            "gradients": grads.total,
            "optimizer temporaries": t.optimizer_temporaries},
    } | _last_linear_phase(t)


def _last_linear_phase(t: StageTerms) -> dict[str, dict[str, float]]:
    """A hybrid's last checkpointed linear-attention block, recomputed in backward with
    the inputs of the blocks before it still kept and the gradients of those after it
    done (``StageActivations.last_linear``); none without one."""
    act, grads = t.activations, t.gradients
    if act.last_linear is None:
        return {}
    after = t.layers - 1 - act.last_linear
    return {"backward: last linear block": {
        "activations": t.tokens * act.at_last_linear,
        "autocast weight copies": t.copies.at_last_block,
        "gradients": grads.in_block_backward(
            grads.before_blocks + after * grads.per_block + grads.mlp_out),
        "backward buffers": t.tokens * act.backward_buffers,
        "dequantization scratch": t.dequantization_scratch,
        "FSDP unsharded parameters": t.fsdp.params_in_blocks,
        "FSDP gradient buffers": t.fsdp.gradients_first_block}}


def step_in_backward_phases(setup: Setup, phases: dict[str, dict[str, float]]) -> None:
    """optim.in_backward: a gradient is consumed by its parameter's step as soon as it is
    complete and freed, so there is no separate optimizer step; backward holds one
    parameter's gradient and step temporaries at a time: a block's largest projection in
    the block phases, the output layer's right after the loss, the embedding's at the end
    (a tied embedding's gradient waits there from the output layer on)."""
    step_bytes = IN_BACKWARD_STEP_BYTES.get(setup.cfg.optim.name,
                                            IN_BACKWARD_STEP_BYTES_DEFAULT)
    grad_bytes = DTYPE_BYTES[setup.cfg.train.param_dtype]
    trainable, args = setup.trainable, setup.args
    largest_projection = largest_trained_matrix(setup)
    table = args.vocab_size * args.dim / setup.layout.tp  # the embedding's, or the head's
    tied = args.tie_embeddings and setup.layout.pp == 1
    waiting = grad_bytes * table if tied and trainable.embedding else 0.0
    del phases["optimizer step"]
    for name in ("backward: last block", "backward: first block",
                 "backward: last linear block"):
        if name not in phases:
            continue
        phases[name]["gradients"] = waiting + grad_bytes * largest_projection
        phases[name]["optimizer temporaries"] = step_bytes * largest_projection
    if trainable.head and not tied:
        phases["backward: output layer step"] = {
            "activations": phases["backward: loss"]["activations"],
            "gradients": grad_bytes * table, "optimizer temporaries": step_bytes * table}
    if trainable.embedding:
        phases["backward: embedding step"] = {
            "gradients": grad_bytes * table, "optimizer temporaries": step_bytes * table}


