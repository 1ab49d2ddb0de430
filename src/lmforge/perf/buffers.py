"""The transient terms of a step's peak (docs/estimate.md): gradients, autocast copies,
FSDP2's gathered weights and reduce-scatter buffers, dequantization scratch and the
optimizer's temporaries, per pipeline stage. ``perf.estimate`` adds them up by phase."""
from __future__ import annotations

from dataclasses import dataclass

from lmforge.perf.activations import in_flight, loss_chunk_tokens
from lmforge.perf.estimate_setup import DTYPE_BYTES, Setup, compute_bytes
from lmforge.perf.weights import (Weights, fsdp_share, is_sparse, stage_layer_ids,
                                  stage_layers)

# Scratch while one weight is dequantized (codes -> int64 indices -> fp32 values -> the
# compute dtype), per parameter of the largest quantized matrix; measured on peft/quant.py.
DEQUANT_SCRATCH_BYTES = {"nf4": 13.0, "int8": 8.0}


# --------------------------------------------------------------------------- gradients

@dataclass
class Gradients:
    """Gradient bytes on one device (a gradient has its parameter's dtype; FSDP2 shards
    it over dp_shard x cp) at the points of the backward where they matter."""
    total: float  # every trainable parameter's: the optimizer step
    per_block: float
    mlp_out: float  # the MLP output projection's, the first a block's backward completes
    before_blocks: float  # the head's and final norm's, done before any block's
    # From the second micro-batch of a step on, the gradients of the earlier ones: every
    # trainable parameter's, held through forward and backward (0 with one micro-batch,
    # with the step fused into backward, and in a pipeline whose peak, with the most
    # micro-batches in flight, comes before the first backward ends: GPipe's, or 1F1B's
    # when every micro-batch is in flight at once).
    accumulated: float = 0.0
    # FSDP2 reduce-scatters the root unit's gradients (head, final norm) only when the
    # whole backward ends: until then they are unsharded, beside any accumulated shard.
    root_unsharded: float = 0.0

    def in_block_backward(self, completed: float) -> float:
        """Bytes while the backward is in the blocks, ``completed`` of this micro-batch's
        sharded gradients done: accumulated in place into the earlier micro-batches'."""
        return max(self.accumulated, completed) + self.root_unsharded


def stage_gradients(setup: Setup, weights: Weights, stage: int) -> Gradients:
    grad_bytes, shard = DTYPE_BYTES[setup.cfg.train.param_dtype], setup.layout.fsdp_shard
    # (this rank's experts under parallel.ep: their gradients sharded over dp_shard / ep)
    w, es = weights, setup.expert_shard
    every = grad_bytes * fsdp_share(w.trainable_params, w.ep_trainable_params, shard, es)
    per_block = grad_bytes * fsdp_share(w.block_trainable, w.ep_block_trainable, shard, es)
    before_blocks = every - stage_layers(setup, stage) * per_block
    args, tied = setup.args, setup.args.tie_embeddings and setup.layout.pp == 1
    if setup.trainable.embedding and stage == 0 and not tied:  # the embedding's comes last
        before_blocks -= grad_bytes * args.vocab_size * args.dim / setup.layout.tp / shard
    before_blocks = max(before_blocks, 0.0)
    accumulates = (setup.batch.microbatches > 1 and not setup.cfg.optim.in_backward
                   and (setup.layout.pp == 1 or setup.cfg.parallel.pp_schedule != "gpipe"
                        and setup.batch.microbatches > in_flight(setup, stage)))
    return Gradients(total=every, per_block=per_block,
                     mlp_out=grad_bytes * fsdp_share(w.mlp_out_trainable,
                                                     w.ep_mlp_out_trainable, shard, es),
                     before_blocks=before_blocks,
                     accumulated=every if accumulates else 0.0,
                     root_unsharded=before_blocks * shard if setup.fsdp else 0.0)


# ------------------------------------------------------------------ transient buffers

@dataclass
class AutocastCopies:
    """autocast's bf16 copies of fp32 weights: trainable ones cached until the forward
    ends, frozen ones made per use; either is kept by its matmul for backward, except
    inside checkpointed blocks (recomputed there, one block at a time: a recompute ends
    holding all of its block's, the MLP output projection's among them). The head's copy
    is kept either way, but made per chunk with a chunked loss."""
    trainable_cache: float
    frozen: float  # the frozen ones of the blocks that are not checkpointed
    kept_for_backward: float  # the blocks' copies their matmuls keep
    one_layer: float  # one block's: what the block in backward holds (or recomputes)
    mlp_out: float  # the MLP output projection's, freed after its backward
    head: float
    head_in_forward: float  # none with a chunked loss (made per chunk)
    last_block_recomputed: bool  # the stage's last block is checkpointed
    first_block_recomputed: bool = False  # ... and its first

    @property
    def at_forward_end(self) -> float:
        return self.trainable_cache + self.frozen + self.head_in_forward

    @property
    def at_backward_loss(self) -> float:
        return self.kept_for_backward + self.head

    @property
    def at_last_block(self) -> float:
        recomputed = self.one_layer if self.last_block_recomputed else 0.0
        return self.kept_for_backward + recomputed - self.mlp_out

    @property
    def at_first_block(self) -> float:
        if self.first_block_recomputed:
            return self.one_layer
        return max(self.one_layer - self.mlp_out, 0.0)


def autocast_copies(setup: Setup, weights: Weights, stage: int) -> AutocastCopies:
    ids = stage_layer_ids(setup, stage)
    layers = max(len(ids), 1)
    # the share of the stage's blocks whose matmuls keep their copies: not checkpointed
    kept_share = sum(not setup.checkpointed(i) for i in ids) / layers
    cache, frozen = 2 * weights.matmul_trainable_fp32, 2 * weights.matmul_frozen_fp32
    frozen += weights.expert_copies  # (an MoE's stacks as multiplied: made per forward too)
    return AutocastCopies(
        trainable_cache=cache, frozen=kept_share * frozen,
        kept_for_backward=kept_share * (cache + frozen),
        one_layer=(cache + frozen) / layers,
        mlp_out=weights.mlp_out_copy, head=weights.head_copy,
        head_in_forward=(0.0 if setup.cfg.train.loss_chunk_tokens or setup.cfg.train.fused_loss
                         else weights.head_copy),
        last_block_recomputed=bool(ids) and setup.checkpointed(ids[-1]),
        first_block_recomputed=bool(ids) and setup.checkpointed(ids[0]))


@dataclass
class FsdpBuffers:
    """What FSDP2 allocates beside the shards, at the phases of a step (parallel/fsdp.py:
    each block is a unit, the root unit holds the stage's embedding, final norm and head
    and is not resharded after forward). Zero 3 gathers a block for its forward and again
    for its backward, prefetching the next one; zero 2 keeps every block gathered from
    forward to backward. In a block's backward its gradients are unsharded (fp32) until
    its reduce-scatter, whose input buffer stays until the next block's is issued."""
    params_outside_blocks: float = 0.0  # forward end and loss: no block being computed
    params_in_blocks: float = 0.0  # a block's backward
    gradients_last_block: float = 0.0  # the last block's MLP output gradients, unsharded
    gradients_first_block: float = 0.0  # ... and the reduce-scatter input kept from before


def fsdp_buffers(setup: Setup, weights: Weights, grads: Gradients, stage: int) -> FsdpBuffers:
    if not setup.fsdp:
        return FsdpBuffers()
    layers, param_bytes = stage_layers(setup, stage), compute_bytes(setup)
    w, shard, es = weights, setup.layout.fsdp_shard, setup.expert_shard
    # parallel.ep: FSDP reduces this rank's experts' gradients when other ranks hold the
    # same ones (Setup.experts_in_fsdp) and gathers them whole for their layer when it
    # shards them (dp_shard / ep > 1; over one rank, HSDP's at ep = dp_shard, it computes
    # with the shard itself: measured, tests/distributed/test_estimate_ep.py)
    in_fsdp = setup.experts_in_fsdp
    block = w.block_total - w.ep_block_total
    root = w.trainable_params + w.frozen_params - w.ep_total - layers * block
    kept = layers if setup.cfg.parallel.zero < 3 else 0
    # the local experts of the MoE layers among the blocks gathered at once
    sparse = sum(is_sparse(setup.args, i) for i in stage_layer_ids(setup, stage))
    experts = w.ep_block_total if es > 1 else 0
    grad_bytes = DTYPE_BYTES[setup.cfg.train.param_dtype]
    mlp_out_sharded = (w.mlp_out_trainable - w.ep_mlp_out_trainable) * grad_bytes / shard
    # the unsharded gradient beyond the shards: the MLP output's, the local down stack's
    in_block_grads = (mlp_out_sharded * (shard - 1)
                      + grad_bytes * w.ep_mlp_out_trainable * (es - 1) / es)
    reduce_input = 4 * (w.block_trainable - (0 if in_fsdp else w.ep_block_trainable))
    return FsdpBuffers(
        params_outside_blocks=param_bytes * (root + kept * block
                                             + min(kept, sparse) * experts),
        params_in_blocks=param_bytes * (root + max(kept, 2) * block
                                        + min(max(kept, 2), sparse) * experts),
        gradients_last_block=in_block_grads,
        gradients_first_block=in_block_grads + reduce_input)


def dequantization_scratch(setup: Setup, weights: Weights) -> float:
    """QLoRA: int64 indices and fp32 values while the largest quantized weight is
    dequantized (the dequantized weight is not kept for backward)."""
    if setup.lora is None or not setup.lora.quantize:
        return 0.0
    return DEQUANT_SCRATCH_BYTES[setup.lora.quantize] * weights.largest_quantized


def optimizer_temporaries(setup: Setup, weights: Weights) -> float:
    """Fused AdamW (the CUDA default): none; foreach AdamW: a sqrt(v) temporary for every
    parameter at once; per-tensor AdamW (CPU): sqrt(v) and its quotient, two of the
    largest parameter."""
    fused = setup.cfg.optim.fused
    if fused is None:
        fused = setup.device == "cuda"
    if fused or setup.cfg.optim.name not in ("adamw", "adam"):
        return 0.0
    if setup.device == "cuda":
        return 4 * fsdp_share(weights.trainable_params, weights.ep_trainable_params,
                              setup.layout.fsdp_shard, setup.expert_shard)
    return 2 * 4 * weights.largest_trainable
