"""Activations: what autograd keeps for backward, per token, walked op by op through one
block of our model as its family describes it (docs/estimate.md, "Activations of one
block" and "Outside the blocks"): Llama's sequential block (RMSNorm, attention, RMSNorm,
SwiGLU) or GPT-J's parallel one (one LayerNorm read by attention and a GELU MLP). An op
keeps only what its backward needs, and only for inputs that require grad, in the dtypes
the run computes in; ``stage_activations`` multiplies them out for a pipeline stage (the
micro-batches it holds at once, activation checkpointing)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from lmforge.models.fused_loss import FUSED_CHUNK_TOKENS
from lmforge.parallel.offload import MIN_OFFLOAD_BYTES
from lmforge.perf.block_walk import Term, BlockWalk
from lmforge.perf import linear_attention
from lmforge.perf.linear_attention import is_linear
from lmforge.perf.estimate_setup import Setup, compute_bytes, linear_lora_key
from lmforge.perf.masks import dense_masks
from lmforge.perf.moe_walk import aux_loss_bytes, moe_backward_buffers
from lmforge.perf.weights import is_sparse, stage_layer_ids

BATCH_BYTES_PER_TOKEN = 16.0  # the batch's input ids and labels (int64)

def per_device(terms: list[Term], setup: Setup) -> float:
    """Bytes per token on one device: tensor parallelism divides the head-split terms,
    and the sequence-split ones with sequence parallelism."""
    total = 0.0
    for term in terms:
        sequence_split = term.split == "seq" and setup.cfg.parallel.sequence_parallel
        if term.split == "heads" or sequence_split:
            total += term.bytes / setup.layout.tp
        else:
            total += term.bytes
    return total


@dataclass
class Activations:
    """Per-token bytes (per device) of what one micro-batch keeps, layer by layer."""
    first_layer: float  # layer 0 (its input may not require grad)
    other_layers: float
    first_terms: list
    other_terms: list
    layer_input: float  # what checkpointing keeps per layer
    head_inputs: float  # final norm + output-linear inputs
    logits: float  # (V) in the activation dtype, until the loss is computed
    log_softmax: float
    batch_inputs: float  # the batch's ids and labels
    backward_buffers: float  # gradient buffers at the MLP's elementwise backward
    # the MLP output projection's saved input, released just before that point
    freed_mlp_out_input: float
    input_is_saved: bool  # the block's first norm keeps the block input itself
    masks: float = 0.0  # the dense attention masks the layers share (perf/masks.py)
    # An MoE's later sparse layers (terms as other_terms'), and what each sparse layer
    # keeps outside the block: the load-balancing loss's softmax (layer 0's apart)
    sparse_layers: float = 0.0
    sparse_terms: list = field(default_factory=list)
    aux_loss: float = 0.0
    first_aux_loss: float = 0.0
    # A hybrid's later linear-attention layers (a Gated DeltaNet in place of attention)
    linear_layers: float = 0.0
    linear_terms: list = field(default_factory=list)
    # Layers after the first whose input does not require grad yet (nothing before them
    # trains: a hybrid's linear layers ahead of the first adapted one under LoRA), and
    # what each saves then
    no_grad_layers: dict = field(default_factory=dict)
    # the most one of the linear layers among them (layer 0 too) holds in its forward
    idle_forward: float = 0.0

    def layer(self, setup: Setup, layer_id: int, first: bool = True) -> float:
        """Bytes per token block ``layer_id`` saves when it keeps everything (``first``:
        block 0 as it is, with an input that may not require grad)."""
        sparse = is_sparse(setup.args, layer_id)
        if layer_id == 0 and first:
            return self.first_layer
        if layer_id in self.no_grad_layers:
            return self.no_grad_layers[layer_id]
        if is_linear(setup.args, layer_id):
            return self.linear_layers
        return self.sparse_layers if sparse else self.other_layers

    def outside(self, setup: Setup, layer_id: int) -> float:
        """What an MoE layer keeps outside its block (checkpointed or not)."""
        if not is_sparse(setup.args, layer_id):
            return 0.0
        return self.first_aux_loss if layer_id == 0 else self.aux_loss


def activation_model(setup: Setup) -> Activations:
    """Walks the first block (its input requires grad only if the embedding trains), a
    later one, and the final norm and head; then the loss head and the backward buffers."""
    args, walker = setup.args, BlockWalk(setup)
    first_terms, output_needs_grad = walker.walk(setup.trainable.embedding,
                                                 is_sparse(args, 0), is_linear(args, 0))
    linear = [i for i in range(args.n_layers) if is_linear(args, i)]
    # (a hybrid MoE's linear layers have experts too: Qwen3-Next, Qwen3.5-MoE)
    linear_terms = walker.walk(True, is_sparse(args, linear[-1]), True)[0] if linear else []
    first_ffn_input = output_needs_grad or setup.trainable.norms  # (close enough for block 0)
    dense = any(not is_sparse(args, i) for i in range(args.n_layers))
    full = [i for i in range(args.n_layers) if not is_linear(args, i)]
    sparse_terms = walker.walk(True, True)[0] if walker.block.moe is not None else []
    if args.n_layers == 1 or not dense:  # (gpt-oss: no dense MLP at all)
        other_terms = sparse_terms if args.n_layers > 1 else first_terms
    elif not full or full == [0]:  # (no full-attention layer after the first)
        other_terms = linear_terms
    else:
        other_terms = walker.walk(True)[0]
    no_grad_layers, idle_forward = _no_grad_layers(setup, walker, output_needs_grad,
                                                   per_device(first_terms, setup))
    if args.n_layers > 1:
        # every later block sees a residual stream that requires grad once anything trains
        output_needs_grad = True
    buffers = freed = 0.0
    if dense:
        mlp_out = walker.names.mlp_output
        mlp_out_input = [t for t in other_terms if t.name.startswith(mlp_out)]
        buffers, freed = _backward_buffers(setup, walker), per_device(mlp_out_input, setup)
    if linear_terms:
        buffers = max(buffers, _linear_block_buffers(setup, walker, linear[0], linear_terms)
                      + freed)
    if sparse_terms:  # an MoE layer's peak comes first; a dense layer's, if larger
        buffers = max(moe_backward_buffers(walker, _dim_per_device(setup)), buffers - freed)
        freed = 0.0
    return Activations(first_layer=per_device(first_terms, setup),
                       other_layers=per_device(other_terms, setup),
                       first_terms=first_terms, other_terms=other_terms,
                       layer_input=walker.residual_bytes * _dim_per_device(setup),
                       head_inputs=per_device(_head_terms(setup, output_needs_grad), setup),
                       # loss parallel: the logits are split over the vocabulary
                       logits=walker.matmul_bytes * args.vocab_size / setup.layout.tp,
                       log_softmax=4 * args.vocab_size / setup.layout.tp,
                       batch_inputs=BATCH_BYTES_PER_TOKEN,
                       backward_buffers=buffers, freed_mlp_out_input=freed,
                       input_is_saved=walker.keeps_block_input(),
                       masks=dense_masks(setup).shared_bytes,
                       sparse_layers=per_device(sparse_terms, setup), sparse_terms=sparse_terms,
                       linear_layers=per_device(linear_terms, setup),
                       linear_terms=linear_terms, no_grad_layers=no_grad_layers,
                       idle_forward=idle_forward,
                       aux_loss=aux_loss_bytes(walker),
                       first_aux_loss=aux_loss_bytes(walker, first_ffn_input))


def _linear_block_buffers(setup: Setup, walker: BlockWalk, layer_id: int,
                          terms: list) -> float:
    """A linear layer's block peaks inside its rule's backward, beside the incoming
    gradient, its MLP's saved tensors gone; or, checkpointed, inside its recompute's
    forward (its rule, or an adapter's sum in its MLP), whose output is never kept
    (``terms``: the block's). (The caller adds the freed MLP-output input back: the
    phases take it off.)"""
    names, trainable = linear_attention.LINEAR_PROJECTIONS, setup.trainable
    trained = tuple(n for n in names if trainable.trains(n) or trainable.rank(n))
    others = trainable.norms or any(trainable.trains(n) or trainable.rank(n)
                                    for n in walker.names.mlp)
    forward, backward = linear_attention.block_backward_bytes_per_token(
        setup.args, setup.layout.tp, layer_id, setup.micro_batch, setup.local_seq,
        walker.residual_bytes, setup.autocast, trained, others, linear_lora_key(setup))
    mlp = linear_attention.keeps_feed_forward(setup.args, layer_id)
    if setup.cfg.train.activation_checkpointing != "none":
        backward = max(backward, forward + (_recompute_start(setup, walker) if mlp else 0.0))
    feed_forward = 0.0  # (an MoE left out of the count: its saved tensors, which the
    if not mlp:  # blocks count)
        mixer = next(i for i, t in enumerate(terms) if t.name.startswith("gated"))
        feed_forward = per_device(terms[mixer + 1:], setup)
    return walker.residual_bytes * _dim_per_device(setup) + backward - feed_forward


def _recompute_start(setup: Setup, walker: BlockWalk) -> float:
    """What a checkpointed block's backward holds beside its output's gradient when it
    first asks for a saved tensor, which starts the recompute: the ops after the MLP's
    output projection save nothing, so that gradient reaches the projection first, cast
    to the compute dtype where the residual stream is wider, gathered under sequence
    parallelism (``_gathered_output_gradient``), and with an adapter there its scaled
    update's gradient too (measured: 256 B per token of a 64-wide bf16 LoRA block)."""
    c = walker.matmul_bytes
    cast = c * _dim_per_device(setup) if c != walker.residual_bytes else 0.0
    adapter = c * setup.args.dim if setup.trainable.rank(walker.names.mlp_output) else 0.0
    return cast + _gathered_output_gradient(setup, walker) + adapter


def _gathered_output_gradient(setup: Setup, walker: BlockWalk) -> float:
    """Under sequence parallelism a row-parallel output projection's result is
    reduce-scattered over the sequence, so its backward first gathers the gradient it
    receives: the whole sequence's, in the compute dtype, beside the block's own (the
    MLP's output projection's, alive through its backward)."""
    if not (setup.cfg.parallel.sequence_parallel and setup.layout.tp > 1):
        return 0.0
    return walker.matmul_bytes * setup.args.dim


def _no_grad_layers(setup: Setup, walker: BlockWalk, output_needs_grad: bool,
                    first_saved: float) -> tuple[dict, float]:
    """{layer: bytes per token} of the layers after the first whose input does not
    require grad (nothing before them trains), with what each saves then; and the most
    a linear one of them that saves nothing (layer 0 too: ``first_saved``) holds at once
    in its forward: its intermediates, none kept, are all alive at the rule's end."""
    args, out, layer_id = setup.args, {}, 1
    while not output_needs_grad and layer_id < args.n_layers:
        terms, output_needs_grad = walker.walk(False, is_sparse(args, layer_id),
                                               is_linear(args, layer_id))
        out[layer_id] = per_device(terms, setup)
        layer_id += 1
    idle = [i for i, saved in {0: first_saved, **out}.items()
            if saved == 0.0 and is_linear(args, i)]
    peak = max((linear_attention.block_backward_bytes_per_token(
        args, setup.layout.tp, i, setup.micro_batch, setup.local_seq, walker.residual_bytes,
        setup.autocast, (), False, (), False)[0] for i in idle), default=0.0)
    return out, peak


def _head_terms(setup: Setup, input_needs_grad: bool) -> list[Term]:
    """The final norm, and the output layer's input when the head trains (a bf16 copy
    under autocast)."""
    head = BlockWalk(setup)
    head.norm("final norm", input_needs_grad)
    if setup.trainable.head:
        nbytes = (2 if head.cast else head.residual_bytes) * setup.args.dim
        head.add("output-layer input", nbytes, "none")
    return head.terms


def _backward_buffers(setup: Setup, walker: BlockWalk) -> float:
    """The peak inside a block's backward, beside the incoming residual gradient: at the
    MLP's activation, with its hidden gradients alive (SwiGLU's silu(g) * u: d(m),
    d(silu(g)) and d(u); GELU: d(gelu(h)) and d(h)) and the output projection's saved
    input just freed, and under sequence parallelism the output's gathered gradient
    (``_gathered_output_gradient``). A checkpointed block recomputed with a LoRA adapter
    on the MLP's last input projection may peak before, at that adapter's sum: the base
    output, the update and the scaled update, three f-sized tensors beside the saved
    ones."""
    hidden = (3 if walker.block.gated else 2) * setup.args.ffn_dim
    last_input = walker.names.mlp_inputs[-1]
    # (selective checkpointing recomputes block 0, so some block is recomputed)
    if setup.cfg.train.activation_checkpointing != "none" and setup.trainable.rank(last_input):
        # the adapter's sum spans the projection's whole output (a fused gate_up: 2 f)
        hidden = max(hidden, 3 * walker.block.shapes[last_input][1])
    return (walker.residual_bytes * _dim_per_device(setup)
            + _gathered_output_gradient(setup, walker)
            + walker.matmul_bytes * hidden / setup.layout.tp)


def _dim_per_device(setup: Setup) -> float:
    """The residual stream's width on one device: sequence parallelism splits it over tp."""
    return setup.args.dim / (setup.layout.tp if setup.cfg.parallel.sequence_parallel else 1)


def in_flight(setup: Setup, stage: int) -> float:
    """Micro-batches whose activations stage ``stage`` holds at once (Korthikanti et al.
    sec. 4.2: 1F1B keeps p - stage on stage ``stage``; interleaving adds (p-1)/(p v))."""
    stages, microbatches = setup.layout.pp, max(setup.batch.microbatches, 1)
    if stages == 1:
        return 1.0
    if setup.cfg.parallel.pp_schedule == "gpipe":
        return float(microbatches)
    held = min(stages - stage, microbatches)
    p = setup.cfg.parallel
    if p.pp_schedule == "interleaved_1f1b" and p.pp_virtual_stages > 1:
        held *= 1 + (stages - 1) / (stages * p.pp_virtual_stages)
    return float(held)


# -------------------------------------------------------------- per pipeline stage

@dataclass
class StageActivations:
    """Bytes per token of activations on one device of a pipeline stage."""
    blocks: float  # every block's saved tensors, for the micro-batches in flight
    blocks_at_first_block: float  # what is left when the backward reaches the first block
    # a checkpointed block's tensors beyond its kept input, while it is recomputed in
    # backward (0 for a block that is not checkpointed): the stage's last and first block
    recomputed_last_block: float
    recomputed_first_block: float
    stage_input: float  # the batch on the first stage; received activations on later ones
    head: float  # final norm and output-layer inputs (last stage)
    logits: float  # freed once the loss is computed (its backward keeps the log-softmax)
    log_softmax: float
    fp32_logits: float  # the fp32 copy of bf16 logits in the loss's forward
    backward_buffers: float  # gradients alive inside a block's backward (its peak)
    freed_mlp_out_input: float  # the MLP output projection's saved input, freed by then
    host: float = 0.0  # what activation offload keeps in pinned host memory instead
    # A pipeline's last stage: the other in-flight micro-batches' head inputs, logits
    # (the stage output, kept for its backward) and log-softmax (kept by the loss)
    pending_heads: float = 0.0
    masks: float = 0.0  # the dense attention masks of the micro-batches in flight
    # inside the forward of a linear layer that saves nothing (Activations.idle_forward),
    # its input beside it; 0 if none
    idle_forward: float = 0.0
    # A hybrid's last checkpointed linear-attention block when a block of another kind
    # ends the stage (Qwen3.5's last is a full one): its recompute, a linear block's,
    # runs beside the inputs the blocks before it keep, more than at either end. Its
    # place in the stage (None: no such block), what the blocks hold at its backward,
    # and what its recompute adds.
    last_linear: Optional[int] = None
    blocks_at_last_linear: float = 0.0
    recomputed_last_linear: float = 0.0

    @property
    def at_forward_end(self) -> float:
        return self.blocks + self.head + self.stage_input + self.pending_heads + self.masks

    @property
    def at_last_block(self) -> float:
        return (self.blocks + self.recomputed_last_block + self.stage_input
                - self.freed_mlp_out_input + self.pending_heads + self.masks)

    @property
    def at_first_block(self) -> float:
        return (self.blocks_at_first_block + self.recomputed_first_block + self.stage_input
                - self.freed_mlp_out_input + self.pending_heads + self.masks)

    @property
    def at_last_linear(self) -> float:
        return (self.blocks_at_last_linear + self.recomputed_last_linear + self.stage_input
                - self.freed_mlp_out_input + self.pending_heads + self.masks)


def stage_activations(setup: Setup, act: Activations, stage: int) -> StageActivations:
    """A checkpointed block keeps its input until its backward, which recomputes the rest,
    one block at a time; another keeps every saved tensor (``kept_by_block``). Pipeline
    parallelism multiplies a stage's blocks by the micro-batches in flight
    (``in_flight``): when one reaches its first block in backward, the others still hold
    theirs."""
    ids, first, last = stage_layer_ids(setup, stage), stage == 0, stage == setup.layout.pp - 1
    held = in_flight(setup, stage)
    kept = [kept_by_block(setup, act, i) for i in ids]
    # On the device with activation offload: the block whose tensors are being copied out
    # (forward) or back ahead of use (backward), and the one computing; the others wait
    # on the host.
    moved = [offloaded_per_layer(setup, act, setup.checkpointed(i))
             if setup.cfg.train.activation_offload else 0.0 for i in ids]
    host = held * sum(moved[:-2])
    blocks = held * sum(kept) - host
    blocks_at_first_block = kept[0] + (held - 1) * (sum(kept) - sum(moved[:-2]))
    linear = [k for k, i in enumerate(ids) if is_linear(setup.args, i) and setup.checkpointed(i)]
    last_linear = linear[-1] if linear and 0 < linear[-1] < len(ids) - 1 else None
    blocks_at_last_linear = 0.0
    if last_linear is not None:  # (the blocks after it done; those before it held)
        blocks_at_last_linear = (sum(kept[:last_linear + 1]) - sum(moved[:last_linear - 1])
                                 + (held - 1) * (sum(kept) - sum(moved[:-2])))
    bf16_logits = compute_bytes(setup) == 2
    pending = (held - 1) * (act.head_inputs + act.logits + act.log_softmax) if last else 0.0
    return StageActivations(
        pending_heads=pending, masks=held * act.masks,
        idle_forward=(act.batch_inputs + act.idle_forward + act.layer_input
                      if first and act.idle_forward else 0.0),
        host=host, blocks=blocks, blocks_at_first_block=blocks_at_first_block,
        recomputed_last_block=recomputed_by_block(setup, act, ids[-1]),
        recomputed_first_block=recomputed_by_block(setup, act, ids[0]),
        last_linear=last_linear, blocks_at_last_linear=blocks_at_last_linear,
        recomputed_last_linear=(0.0 if last_linear is None
                                else recomputed_by_block(setup, act, ids[last_linear])),
        # a later stage receives its input activations
        stage_input=act.batch_inputs * held if first else held * act.layer_input,
        head=act.head_inputs if last else 0.0, logits=act.logits if last else 0.0,
        log_softmax=act.log_softmax if last else 0.0,
        fp32_logits=4 * setup.args.vocab_size / setup.layout.tp if bf16_logits and last else 0,
        backward_buffers=act.backward_buffers, freed_mlp_out_input=act.freed_mlp_out_input)


def kept_by_block(setup: Setup, act: Activations, layer_id: int) -> float:
    """Bytes per token block ``layer_id`` keeps from its forward to its backward: its
    input when checkpointed, else every tensor it saves (block 0 saves less when its
    input, the embedding's output, does not require grad)."""
    if setup.checkpointed(layer_id):
        return act.layer_input + act.outside(setup, layer_id)
    return act.layer(setup, layer_id) + act.outside(setup, layer_id)


def recomputed_by_block(setup: Setup, act: Activations, layer_id: int) -> float:
    """What recomputing block ``layer_id`` in backward adds beside the input it kept (the
    block's first norm keeps that input itself when it saves its input as is)."""
    if not setup.checkpointed(layer_id):
        return 0.0
    own = act.layer(setup, layer_id, first=False)
    return own - (act.layer_input if act.input_is_saved else 0.0)


def offloaded_per_layer(setup: Setup, act: Activations, checkpointed: bool) -> float:
    """Bytes per token of one block's saved tensors that activation offload moves: of a
    checkpointed block the input it keeps, of another every saved tensor of at least
    ``MIN_OFFLOAD_BYTES`` for a micro-batch (``parallel/offload.py``'s rule; smaller ones
    stay, as do weights, which are not activations here)."""
    tokens = setup.tokens
    sizes = ([act.layer_input] if checkpointed
             else [per_device([t], setup) for t in act.other_terms])
    return sum(b for b in sizes if b * tokens >= MIN_OFFLOAD_BYTES)


def loss_chunk_tokens(setup: Setup) -> int:
    """Tokens whose logits exist at once: train.loss_chunk_tokens makes (and recomputes
    in backward) one chunk's logits at a time, as train.fused_loss does (its default
    chunk: FUSED_CHUNK_TOKENS), which keeps no logits between forward and backward;
    else the whole micro-batch's."""
    tokens = setup.tokens
    chunk = setup.cfg.train.loss_chunk_tokens
    if setup.cfg.train.fused_loss:
        chunk = chunk or FUSED_CHUNK_TOKENS
    return min(chunk, tokens) if chunk else tokens
