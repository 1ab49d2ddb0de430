"""The static terms' raw material: the parameters one device holds on a pipeline stage,
how many train, and the bytes the trainer stores them in (docs/estimate.md, "Weights"
and "Sharding"); plus the bf16 weight copies autocast makes of them."""
from __future__ import annotations

import math
from dataclasses import dataclass

from lmforge.config import JobConfig
from lmforge.job import resolve
from lmforge.models.registry import BlockSpec, family_of
from lmforge.parallel import pipeline
from lmforge.perf.estimate_setup import DTYPE_BYTES, Setup, frozen_weight_dtype
from lmforge.perf.flops import ROUTER, SHARED_EXPERTS, projection_shapes
from lmforge.perf import linear_attention
from lmforge.perf.mla import latent_attention
from lmforge.perf.moe_walk import shared_width

# Bytes per parameter of a quantized frozen weight (peft/quant.py): NF4 packs two 4-bit
# codes per byte plus one absmax per block of 64, itself int8 with an fp32 scale per 256
# blocks (double quantization); int8 is one byte plus one fp32 scale per output row.
NF4_BLOCK, NF4_SCALE_GROUP = 64, 256


@dataclass
class Weights:
    """Bytes of parameter storage on one device, split the way the table shows them."""
    trainable_params: int = 0
    trainable_bytes: float = 0.0
    frozen_params: int = 0
    frozen_bytes: float = 0.0
    # Blocks' matmul weights that autocast copies to bf16: trainable ones are cached for
    # the whole forward, frozen fp32 ones copied at each use (elements).
    matmul_trainable_fp32: int = 0
    matmul_frozen_fp32: int = 0
    head_copy: float = 0.0  # bytes of the output layer's bf16 weight copy under autocast
    largest_trainable: int = 0
    largest_quantized: int = 0
    block_trainable: int = 0  # per block, for FSDP transients
    block_total: int = 0
    # The MLP's output projection (Llama's down_proj, GPT-J's fc_out), the first whose
    # gradients a block's backward completes: its trainable parameters (weight, bias
    # and/or adapter) and the bytes of its autocast bf16 weight copy.
    mlp_out_trainable: int = 0
    mlp_out_copy: float = 0.0
    # An MoE layer's stacked experts as its forward multiplies by them, beside the
    # weights (bytes, the stage's blocks): the bf16 copy grouped_linear makes under
    # autocast, or a LoRA run's folded W + scaling B A (peft.expert_lora), each made per
    # forward and kept by the grouped product for backward.
    expert_copies: float = 0.0
    # Expert parallelism (parallel.ep > 1): the part of the totals above that is this
    # rank's n_experts / ep routed experts (with their LoRA adapters), whole: FSDP shards
    # them over Setup.expert_shard = dp_shard / ep ranks, not dp_shard (``fsdp_share``),
    # and gathers them whole only then. Parameters that train, bytes of trained and
    # frozen ones, per block (the last's, as block_trainable), and the down stack's share
    # of mlp_out_trainable.
    ep_trainable_params: int = 0
    ep_trainable_bytes: float = 0.0
    ep_frozen_bytes: float = 0.0
    ep_block_trainable: int = 0
    ep_block_total: int = 0
    ep_mlp_out_trainable: int = 0
    ep_total: int = 0  # every local expert parameter, trained or frozen


def fsdp_share(total: float, expert_parallel: float, shard: int,
               expert_shard: int = 1) -> float:
    """What one device holds of ``total``: FSDP's 1 / ``shard`` of it, except the
    ``expert_parallel`` part (this rank's experts under parallel.ep), of which it holds
    1 / ``expert_shard`` (dp_shard / ep; 1: whole). Either way the experts come to
    total / dp_shard per rank: E / ep experts over dp_shard / ep ranks."""
    return (total - expert_parallel) / shard + expert_parallel / expert_shard


def model_parameters(args) -> int:
    """The whole model's parameters (a tied embedding once, no LoRA adapters), as the
    estimate counts them."""
    one_device = JobConfig()
    one_device.data.seq_len, one_device.train.device = 1, "cpu"
    setup = Setup(resolve(one_device, args=args))
    return stage_weights(setup, 0).trainable_params


def stage_layer_ids(setup: Setup, stage: int) -> list[int]:
    """The model's ids of the blocks on pipeline rank ``stage``, as the trainer splits it
    (``parallel/pipeline.py``): pp x pp_virtual_stages even stages, rank r holding stages
    r, r + pp, ... Which of them activation checkpointing recomputes depends on the ids."""
    virtual = setup.cfg.parallel.pp_virtual_stages
    stages = pipeline.stage_layers(setup.args.n_layers, setup.layout.pp * virtual)
    return [i for s in pipeline.stage_ids_for_rank(stage, setup.layout.pp, virtual)
            for i in stages[s]]


def stage_layers(setup: Setup, stage: int) -> int:
    """Blocks on pipeline rank ``stage``."""
    return len(stage_layer_ids(setup, stage))


def quantized_bytes(kind: str, n_in: int, n_out: int) -> float:
    """Storage of one quantized ``n_in x n_out`` weight (codes, absmaxes and scales)."""
    if kind == "nf4":
        n = n_in * n_out
        blocks = math.ceil(n / NF4_BLOCK)
        return n / 2 + blocks + 4 * math.ceil(blocks / NF4_SCALE_GROUP) + 4
    if kind == "int8":
        return n_in * n_out + 4 * n_out
    raise ValueError(f"lora.quantize: {kind!r} is not one of nf4, int8")


class _Tally:
    """Adds tensors to a ``Weights`` in the dtypes the trainer stores them: trained ones,
    embeddings and norms in train.param_dtype, frozen projections in the frozen weights'
    dtype, quantized ones in their packed storage."""

    def __init__(self, setup: Setup):
        self.weights = Weights()
        self.param_bytes = DTYPE_BYTES[setup.cfg.train.param_dtype]
        self.frozen_projection_bytes = DTYPE_BYTES[frozen_weight_dtype(setup)]

    def add(self, n: float, trains: bool, matmul: bool) -> None:
        """``n`` parameters; ``matmul``: a projection or the head (autocast copies it)."""
        if trains:
            self._add_trained(int(n), matmul)
        else:
            self._add_frozen(int(n), matmul)

    def add_stored(self, n: float, trains: bool, matmul: bool) -> None:
        """``n`` parameters stored in train.param_dtype whether they train or not (an
        MoE's router and stacked experts: no nn.Linear for the frozen base's cast)."""
        if trains:
            self._add_trained(int(n), matmul)
        else:
            self.weights.frozen_params += int(n)
            self.weights.frozen_bytes += self.param_bytes * int(n)

    def add_quantized(self, n: float, storage: float) -> None:
        self.weights.frozen_params += int(n)
        self.weights.frozen_bytes += storage

    def _add_trained(self, n: int, matmul: bool) -> None:
        w = self.weights
        w.trainable_params += n
        w.trainable_bytes += self.param_bytes * n
        w.largest_trainable = max(w.largest_trainable, n)
        if matmul:
            w.matmul_trainable_fp32 += n

    def _add_frozen(self, n: int, matmul: bool) -> None:
        w = self.weights
        w.frozen_params += n
        w.frozen_bytes += (self.frozen_projection_bytes if matmul else self.param_bytes) * n
        if matmul and self.frozen_projection_bytes == 4:
            w.matmul_frozen_fp32 += n


def stage_weights(setup: Setup, stage: int) -> Weights:
    """Parameter storage of pipeline stage ``stage`` on one of its devices, after tensor
    parallelism (the estimate divides by dp_shard for FSDP): its blocks, the embedding on
    the first stage, the final norm and the head on the last."""
    args, tp = setup.args, setup.layout.tp
    tally = _Tally(setup)
    for layer_id in stage_layer_ids(setup, stage):
        _add_block(tally, setup, layer_id)
    if stage == 0:
        tally.add(args.vocab_size * args.dim / tp, setup.trainable.embedding, matmul=False)
    if stage == setup.layout.pp - 1:
        _add_final_norm_and_head(tally, setup)
    w = tally.weights
    if not setup.autocast:
        # fp32 compute casts nothing; FSDP2 computes with parameters gathered as bf16
        w.matmul_trainable_fp32 = w.matmul_frozen_fp32 = 0
        w.head_copy = 0.0
    return w


def norm_params(block: BlockSpec, dim: int) -> int:
    """Parameters of one norm: RMSNorm's weight, or LayerNorm's weight and bias."""
    return 2 * dim if block.norm == "layer" else dim


def bias_per_device(setup: Setup, name: str, n_out: int) -> float:
    """A linear layer's bias on one device: split with the output of a column-parallel
    projection (and of the vocabulary-parallel head); added once, replicated, after the
    row-parallel ones (the attention's and the MLP's output projections) reduce."""
    projections = family_of(setup.args).projections
    row_parallel = name in (projections.attention_output, projections.mlp_output)
    return n_out if row_parallel else n_out / setup.layout.tp


def _add_block(tally: _Tally, setup: Setup, layer_id: int) -> None:
    """One transformer block: its projections (quantized when frozen under QLoRA, with
    their adapters and biases), its norms (one in a parallel block, else two), an MoE
    layer's experts in place of the MLP; records the block's totals for the FSDP
    transients."""
    w, trainable, tp = tally.weights, setup.trainable, setup.layout.tp
    family = family_of(setup.args)
    sparse = is_sparse(setup.args, layer_id)
    skipped = set(family.projections.mlp) if sparse else set()
    linear = linear_attention.is_linear(setup.args, layer_id)
    shapes = projection_shapes(setup.args)
    if linear:  # a Gated DeltaNet's projections in place of the attention's
        skipped |= set(family.projections.attention)
        shapes.update(linear_attention.projection_shapes(setup.args))
    biased = family.block(setup.args).biased
    quantize = setup.lora.quantize if setup.lora is not None else None
    trainable_before, ep_trainable_before = w.trainable_params, w.ep_trainable_params
    total_before, ep_total_before = w.trainable_params + w.frozen_params, w.ep_total
    for name, (n_in, n_out) in shapes.items():
        if name in skipped:
            continue
        trains, rank = trainable.trains(name), trainable.rank(name)
        if not trains and quantize:
            tally.add_quantized(n_in * n_out / tp, quantized_bytes(quantize, n_in, n_out) / tp)
            w.largest_quantized = max(w.largest_quantized, n_in * n_out // tp)
        else:
            tally.add(n_in * n_out / tp, trains, matmul=True)
        if rank:
            tally.add(rank * (n_in + n_out / tp), True, matmul=True)
        bias = 0.0
        if name in biased:  # trains with its weight; kept unquantized in the param dtype,
            # and no matmul keeps its autocast copy for backward (not a matmul weight)
            bias = bias_per_device(setup, name, n_out)
            tally.add(bias, trains, matmul=False)
        if name == family.projections.mlp_output:
            _add_mlp_output_terms(tally, setup, trains, rank, (n_in, n_out), bias)
    if sparse:
        _add_experts(tally, setup)
    norms = len(family.block(setup.args).norms)
    # Qwen3's q and k norms: one head_dim weight each, shared by the heads (replicated
    # under tensor parallelism)
    head_norms = 2 * setup.args.head_dim if family.block(setup.args).head_norms else 0
    if linear:  # no q/k norms; the convolution, dt_bias, A_log and the gated norm (which
        # train with the norms: no LoRA target, frozen under LoRA), split with the heads
        head_norms = linear_attention.other_parameters(setup.args, tp)
    mla = latent_attention(setup.args)  # MLA's q and kv latent norms
    latent_norms = mla.latent_norm_params if mla is not None else 0
    tally.add(norms * norm_params(family.block(setup.args), setup.args.dim) + head_norms
              + latent_norms, trainable.norms, matmul=False)
    w.block_trainable = w.trainable_params - trainable_before
    w.block_total = w.trainable_params + w.frozen_params - total_before
    w.ep_block_trainable = w.ep_trainable_params - ep_trainable_before
    w.ep_block_total = w.ep_total - ep_total_before


def _add_mlp_output_terms(tally: _Tally, setup: Setup, trains: bool, rank: int,
                          shape: tuple[int, int], bias: float) -> None:
    """The MLP output projection's trainable parameters (its gradients are the first a
    block's backward completes) and the bf16 copies autocast makes for it, freed after
    its backward: the weight's if it is fp32 (trained, or frozen fp32), and the
    adapter's."""
    n_in, n_out = shape
    w, quantize = tally.weights, setup.lora.quantize if setup.lora is not None else None
    w.mlp_out_trainable = ((trains * n_in * n_out + rank * (n_in + n_out)) // setup.layout.tp
                           + int(trains * bias))
    fp32_base = trains or (not quantize and tally.frozen_projection_bytes == 4)
    copied = ((n_in * n_out if fp32_base else 0) + rank * (n_in + n_out)) / setup.layout.tp
    w.mlp_out_copy = 2.0 * copied if setup.autocast else 0.0


def _add_final_norm_and_head(tally: _Tally, setup: Setup) -> None:
    """The last stage's final norm and output layer (with its bias, if it has one). The
    head's autocast copy is counted apart (``head_copy``: it is kept until its backward),
    not with the blocks' copies."""
    w, args, trainable = tally.weights, setup.args, setup.trainable
    family = family_of(args)
    block_copies = (w.matmul_trainable_fp32, w.matmul_frozen_fp32)
    tally.add(norm_params(family.block(args), args.dim), trainable.norms, matmul=False)
    tied = args.tie_embeddings and setup.layout.pp == 1
    if not tied:  # (tied: the embedding's storage, already counted)
        tally.add(args.vocab_size * args.dim / setup.layout.tp, trainable.head, matmul=True)
    if "output" in family.block(args).biased:
        tally.add(bias_per_device(setup, "output", args.vocab_size), trainable.head,
                  matmul=False)
    if trainable.head or tally.frozen_projection_bytes == 4 or tied:
        # (tied: the fp32 embedding)
        w.head_copy = 2.0 * args.vocab_size * args.dim / setup.layout.tp
    w.matmul_trainable_fp32, w.matmul_frozen_fp32 = block_copies


# ------------------------------------------------------------------ mixture of experts

def is_sparse(args, layer_id: int) -> bool:
    """Whether layer ``layer_id`` is an MoE (``BlockSpec.sparse_layers``)."""
    block = family_of(args).block(args)
    return block.moe is not None and layer_id in (block.sparse_layers or ())


def active_parameters(args) -> int:
    """The parameters one token's forward uses: every parameter but the experts a token
    is not routed to (n_experts - top_k of each MoE layer's, with their biases); the
    router, shared experts, attention, norms, embedding and head all count."""
    block = family_of(args).block(args)
    total = model_parameters(args)
    if block.moe is None:
        return total
    moe = block.moe
    expert = 3 * moe.dim * moe.ffn_dim + (2 * moe.ffn_dim + moe.dim) * moe.expert_bias
    return total - len(block.sparse_layers or ()) * (moe.n_experts - moe.top_k) * expert


def largest_trained_matrix(setup: Setup) -> float:
    """The largest trained weight of a block on one device: a projection (a linear
    layer's too), or an MoE's stacked experts (one parameter of experts x out x in)."""
    trainable, args = setup.trainable, setup.args
    shapes = projection_shapes(args)
    if linear_attention.linear_layers(args):
        shapes |= linear_attention.projection_shapes(args)
    sizes = [n_in * n_out / setup.layout.tp for name, (n_in, n_out)
             in shapes.items() if trainable.trains(name)]
    moe = family_of(args).block(args).moe
    if moe is not None:
        gate_up, down = family_of(args).projections.experts
        stack = moe.n_experts // setup.ep * moe.dim * moe.ffn_dim  # (this rank's)
        sizes += [2 * stack] * trainable.trains(gate_up) + [stack] * trainable.trains(down)
    return max(sizes, default=0.0)


def _add_experts(tally: _Tally, setup: Setup) -> None:
    """One MoE layer's parameters: the router (in train.param_dtype whether it trains or
    not: it is no nn.Linear, so a LoRA run's bf16 base leaves it fp32), the stacked
    experts (frozen ones stored as the frozen projections, ``precision.
    frozen_linears_to_bf16``) with their biases and LoRA adapters, the shared experts (a
    GatedMLP of linear layers, stored as the dense projections); and the experts'
    per-forward copies (``Weights.expert_copies``) and the down stack's share of the
    MLP-output terms."""
    w, trainable, moe = tally.weights, setup.trainable, family_of(setup.args).block(setup.args).moe
    d, e, f = moe.dim, moe.n_experts, moe.ffn_dim
    trains = trainable.trains(ROUTER)
    tally.add_stored(d * e + e * moe.router_bias, trains, matmul=trains)
    if not trains and tally.param_bytes == 4:
        w.matmul_frozen_fp32 += d * e  # (autocast's bf16 copy per use)
    gate_up, down = family_of(setup.args).projections.experts
    e //= setup.ep  # (expert parallelism: this rank's experts and their adapters)
    for name, (n_out, n_in) in ((gate_up, (2 * f, d)), (down, (d, f))):
        trains, rank = trainable.trains(name), trainable.rank(name)
        stack = e * n_in * n_out
        before = (w.trainable_params, w.trainable_bytes, w.frozen_params, w.frozen_bytes)
        tally.add_stored(e * n_out * moe.expert_bias, trains, matmul=False)
        if trains:
            tally.add_stored(stack, True, matmul=False)
        else:  # (a frozen stack: stored as the frozen projections)
            tally.add_quantized(stack, tally.frozen_projection_bytes * stack)
        tally.add_stored(e * rank * (n_in + n_out), True, matmul=False)
        if setup.ep > 1:
            _add_expert_parallel(w, before)
        stored = tally.param_bytes if trains else tally.frozen_projection_bytes
        copy = _expert_copy_bytes(setup, stored, rank) * stack
        if rank and (setup.autocast or _expert_parallel_cast(setup)
                     and tally.param_bytes == 4):  # bf16 copies of A and B
            copy += 2 * e * rank * (n_in + n_out)
        w.expert_copies += copy
        if name == down:
            w.mlp_out_trainable = trains * stack + e * rank * (n_in + n_out)
            w.ep_mlp_out_trainable = w.mlp_out_trainable if setup.ep > 1 else 0
            w.mlp_out_copy = copy
    shared = shared_width(moe)
    if shared:  # (with Qwen's gate, a d x 1 projection)
        gate = d * getattr(moe, "shared_expert_gate", False)
        tally.add(3 * d * shared + gate, trainable.trains(SHARED_EXPERTS), matmul=True)


def _add_expert_parallel(w: Weights, before: tuple) -> None:
    """Records what the stack just added (``before``: the totals before it) as this
    rank's expert-parallel share, which FSDP leaves whole."""
    trainable, trainable_bytes, frozen, frozen_bytes = before
    w.ep_trainable_params += w.trainable_params - trainable
    w.ep_trainable_bytes += w.trainable_bytes - trainable_bytes
    w.ep_frozen_bytes += w.frozen_bytes - frozen_bytes
    w.ep_total += w.trainable_params - trainable + w.frozen_params - frozen


def _expert_copy_bytes(setup: Setup, stored: int, rank: int) -> float:
    """Bytes per element of a stack's per-forward copy (stored in ``stored`` bytes): the
    bf16 copy of an fp32 one under autocast, or under ep = dp_shard with FSDP's half
    param_dtype (``_expert_parallel_cast``); else none (LoRA on a stack adds two
    rank-wide products, no adapted copy: ``peft.expert_lora``)."""
    cast = setup.autocast or _expert_parallel_cast(setup)
    return 2.0 if cast and stored == 4 else 0.0


def _expert_parallel_cast(setup: Setup) -> bool:
    """Whether the local experts, held whole (ep = dp_shard), are cast to a half compute
    dtype per forward: without dp_replicate FSDP ignores them and ``ExpertParallelMixin``
    casts them, the grouped product keeping the copy; under HSDP FSDP's param_dtype
    makes the same copy (counted alike). Below ep = dp_shard FSDP gathers them in its
    param_dtype: the gathered stack is its buffer (``buffers.fsdp_buffers``)."""
    return setup.ep > 1 and setup.expert_shard == 1 and setup.fsdp and setup.half
