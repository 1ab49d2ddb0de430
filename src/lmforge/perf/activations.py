"""Activations: what autograd keeps for backward, per token, walked op by op through one
block of our model as its family describes it (docs/estimate.md, "Activations of one
block" and "Outside the blocks"): Llama's sequential block (RMSNorm, attention, RMSNorm,
SwiGLU) or GPT-J's parallel one (one LayerNorm read by attention and a GELU MLP). An op
keeps only what its backward needs, and only for inputs that require grad, in the dtypes
the run computes in; ``stage_activations`` multiplies them out for a pipeline stage (the
micro-batches it holds at once, activation checkpointing)."""
from __future__ import annotations

from dataclasses import dataclass

from lmforge.models.registry import family_of
from lmforge.parallel.offload import MIN_OFFLOAD_BYTES
from lmforge.perf.estimate_setup import Setup, adapter_bytes, compute_bytes, residual_bytes
from lmforge.perf.weights import stage_layer_ids

BATCH_BYTES_PER_TOKEN = 16.0  # the batch's input ids and labels (int64)


@dataclass
class Term:
    """Bytes per token of one tensor kept for backward. ``split``: how tensor parallelism
    divides it: "heads" (always by tp), "seq" (by tp with sequence parallelism), "none"."""
    name: str
    bytes: float
    split: str = "heads"


class _BlockWalk:
    """Walks one block the way autograd sees it, collecting the terms it saves.

    ``residual_bytes`` is R and ``matmul_bytes`` C of docs/estimate.md; ``cast``: autocast
    copies fp32 activations to bf16 at every matmul."""

    def __init__(self, setup: Setup):
        self.setup, self.args, self.trainable = setup, setup.args, setup.trainable
        self.family = family_of(setup.args)
        self.names = self.family.projections
        self.block = self.family.block(setup.args)
        self.matmul_bytes = compute_bytes(setup)
        self.residual_bytes = residual_bytes(setup)
        self.autocast = setup.autocast
        self.cast = self.autocast and self.residual_bytes == 4
        self.adapter_bytes = adapter_bytes(setup)
        self.dropout = setup.lora is not None and setup.lora.dropout > 0
        self.terms: list[Term] = []

    def add(self, name: str, nbytes: float, split: str = "heads") -> None:
        if nbytes:
            self.terms.append(Term(name, nbytes, split))

    def needs_grad(self, projection: str, input_needs_grad: bool) -> bool:
        """Whether a projection's output requires grad."""
        return (input_needs_grad or self.trainable.trains(projection)
                or self.trainable.rank(projection) > 0)

    def walk(self, input_needs_grad: bool) -> tuple[list[Term], bool]:
        """The terms one block saves, and whether its output requires grad."""
        self.terms = []
        qkv, mlp_inputs = self.names.attention[:-1], self.names.mlp_inputs
        normed_needs_grad = self.norm("attention norm", input_needs_grad)
        if self.block.parallel:  # x + attention(norm(x)) + mlp(norm(x))
            self._parallel_block_inputs(normed_needs_grad)
            attention_needs_grad = self._attention(normed_needs_grad)
            mlp_needs_grad = self._mlp(normed_needs_grad)
            return list(self.terms), input_needs_grad or attention_needs_grad or mlp_needs_grad
        self.block_inputs(qkv, normed_needs_grad)
        attention_needs_grad = self._post_norm("post-attention norm",
                                               self._attention(normed_needs_grad))
        hidden_needs_grad = input_needs_grad or attention_needs_grad  # h = x + attention
        ffn_normed_needs_grad = self.norm("ffn norm", hidden_needs_grad)
        self.block_inputs(mlp_inputs, ffn_normed_needs_grad)
        mlp_needs_grad = self._post_norm("post-MLP norm", self._mlp(ffn_normed_needs_grad))
        return list(self.terms), hidden_needs_grad or mlp_needs_grad

    def _post_norm(self, label: str, branch_needs_grad: bool) -> bool:
        """A branch output's own norm before the residual add (Gemma 3), over the output
        projection's result; whether its output requires grad."""
        if not self.block.post_norms:
            return branch_needs_grad
        return self._rms_norm(label, branch_needs_grad, self.args.dim, 1, self.matmul_bytes,
                              "seq")

    def _parallel_block_inputs(self, normed_needs_grad: bool) -> None:
        """One norm output read by q/k/v and by the MLP's input projection(s): one copy
        kept for all, unless sequence parallelism gathers it for each branch apart (the
        tensor-parallel plan prepares each branch's input)."""
        qkv, mlp_inputs = self.names.attention[:-1], self.names.mlp_inputs
        if self.setup.sequence_parallel and self.setup.tp > 1:
            self.block_inputs(qkv, normed_needs_grad)
            self.block_inputs(mlp_inputs, normed_needs_grad)
        else:
            self.block_inputs(qkv + mlp_inputs, normed_needs_grad)

    def block_inputs(self, consumers: tuple[str, ...], input_needs_grad: bool) -> None:
        """The copies kept of a norm's output by the projections that read it."""
        label = "/".join(name.removesuffix("_proj") for name in consumers) + " input"
        self.linear_inputs(label, self.args.dim, input_needs_grad, list(consumers),
                           self.residual_bytes)

    def norm(self, label: str, input_needs_grad: bool) -> bool:
        """The norm's saved tensors; whether its output requires grad."""
        if self.block.norm == "layer":
            return self._layer_norm(label, input_needs_grad)
        return self._rms_norm(label, input_needs_grad, self.args.dim, 1,
                              self.residual_bytes, "seq")

    def _rms_norm(self, label: str, input_needs_grad: bool, width: int, rows: int,
                  in_bytes: int, split: str) -> bool:
        """RMSNorm over ``width`` features per token in ``rows`` groups (one, or one per
        head), of an input of ``in_bytes``: its saved tensors; whether its output
        requires grad."""
        if input_needs_grad:  # x.float() (the input itself when fp32), rsqrt: kept by pow, mul
            self.add(f"{label} input (fp32)", 4 * width, split)
            self.add(f"{label} rsqrt", 4 * rows, split)
        if self.trainable.norms:  # weight * y keeps y for the weight's gradient: in the
            # input's dtype, or fp32 where y * (1 + weight) is computed in fp32 (Gemma)
            y_bytes = 4 if self.block.norm == "rms_one_plus" else in_bytes
            self.add(f"{label} normalized", y_bytes * width, split)
        return input_needs_grad or self.trainable.norms

    def _layer_norm(self, label: str, input_needs_grad: bool) -> bool:
        """native_layer_norm keeps its input and each token's mean and rstd, for the
        input's gradient and the weight's and bias's alike; the statistics are fp32 on
        CUDA, in the input's dtype on the CPU."""
        output_needs_grad = input_needs_grad or self.trainable.norms
        if output_needs_grad:
            stat_bytes = 4 if self.setup.device == "cuda" else self.residual_bytes
            self.add(f"{label} input", self.residual_bytes * self.args.dim, "seq")
            self.add(f"{label} mean, rstd", 2 * stat_bytes, "seq")
        return output_needs_grad

    def keeps_block_input(self) -> bool:
        """Whether the block's first norm keeps the block's input itself: LayerNorm keeps
        its input; RMSNorm keeps ``x.float()``, the input itself when it is fp32."""
        return self.block.norm == "layer" or self.residual_bytes == 4

    def linear_inputs(self, label: str, n_in: int, input_needs_grad: bool,
                      consumers: list[str], in_bytes: int, split: str = "none",
                      counted: bool = False) -> None:
        """Copies of one activation kept by the matmuls that read it (``consumers``).
        A trained weight's matmul keeps its input (a private bf16 copy under autocast when
        the input is fp32); a LoRA adapter keeps ``dropout(x).to(adapter dtype)``, which
        autocast casts again (a private bf16 copy). ``counted``: the activation is already
        kept by another op, so sharing it costs nothing more."""
        trained = [n for n in consumers if self.trainable.trains(n)]
        adapted = [n for n in consumers if self.trainable.rank(n)]
        private_copies, shared, masks = 0.0, False, 0
        if trained:
            if self.autocast and in_bytes == 4:
                private_copies += 2 * len(trained)
            else:
                shared = True
        # the dropout mask: bool from the fused CUDA kernel, the input's dtype on CPU
        mask_bytes = 1 if self.setup.device == "cuda" else in_bytes
        for _ in adapted:
            if self.dropout and input_needs_grad:
                masks += mask_bytes
            if self.autocast:
                private_copies += 2
            elif self.dropout or in_bytes != self.adapter_bytes:
                private_copies += self.adapter_bytes
            else:
                shared = True
        self.add(f"{label} dropout masks", masks * n_in, split)
        self.add(f"{label} copies", private_copies * n_in, split)
        if shared and not counted:
            self.add(label, in_bytes * n_in, split)

    def adapter(self, name: str) -> None:
        rank = self.trainable.rank(name)
        if rank:
            self.add(f"{name} lora_a output", self.matmul_bytes * rank, "heads")

    def _attention(self, normed_needs_grad: bool) -> bool:
        """q/k/v (their input kept by ``block_inputs``) -> RoPE -> SDPA -> the output
        projection; whether its output requires grad."""
        args = self.args
        q_dim = args.n_heads * args.head_dim
        inputs, out = self.names.attention[:-1], self.names.attention_output
        for name in inputs:
            self.adapter(name)
        # q, k and v, each from its projection or all three from a fused one
        q, k, v = (self.needs_grad(name, normed_needs_grad)
                   for name in self.block.sources(inputs))
        q, k, roped_bytes = self._head_norms(q, k)
        self._rope(q, k, roped_bytes)
        scores_need_grad = q or k or v
        if scores_need_grad:
            self._sdpa()
        # The output projection's input: a view of the SDPA output, which the
        # flash/efficient kernels (CUDA and CPU) write as (batch, seq, heads, head_dim);
        # a copy in eager.
        is_view = scores_need_grad and self.setup.attention != "eager"
        self.linear_inputs(f"{out} input", q_dim, scores_need_grad, [out],
                           self.matmul_bytes, "heads", counted=is_view)
        self.adapter(out)
        return self.needs_grad(out, scores_need_grad)

    def _head_norms(self, q_needs_grad: bool, k_needs_grad: bool) -> tuple[bool, bool, int]:
        """Qwen3's and Gemma 3's RMSNorm over each q and k head (before RoPE), split with
        the heads: whether q and k require grad after it, and their bytes then (Qwen3's
        fp32 weight times the normalized y makes them fp32 under autocast; Gemma's norm
        casts back to the input's dtype)."""
        if not self.block.head_norms:
            return q_needs_grad, k_needs_grad, self.matmul_bytes
        args, c = self.args, self.matmul_bytes
        q = self._rms_norm("q norm", q_needs_grad, args.n_heads * args.head_dim,
                           args.n_heads, c, "heads")
        k = self._rms_norm("k norm", k_needs_grad, args.n_kv_heads * args.head_dim,
                           args.n_kv_heads, c, "heads")
        return q, k, 4 if self.autocast and self.block.norm == "rms" else c

    def _rope(self, q_needs_grad: bool, k_needs_grad: bool, roped_bytes: int) -> None:
        """Each attention computes fp32 cos/sin tables (batch, seq, rotary features: the
        head dim, or GPT-J's first rotary_dim): kept as they are when q and k are fp32
        (``roped_bytes``); in bf16 each rotary call keeps bf16 copies, two per call (q
        and k)."""
        features = self.block.rotary_features
        if roped_bytes == 4 and (q_needs_grad or k_needs_grad):
            self.add("rope cos/sin (fp32)", 2 * 4 * features, "none")
        elif roped_bytes != 4:
            calls = q_needs_grad + k_needs_grad
            self.add("rope cos/sin copies", calls * 2 * roped_bytes * features, "none")

    def _sdpa(self) -> None:
        args, out_bytes = self.args, self.matmul_bytes
        q_dim, kv_dim = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        if self.setup.attention == "eager":  # HF eager: k/v repeated, S x S kept twice
            self.add("q (roped)", out_bytes * q_dim)
            self.add("k, v repeated to all heads", 2 * out_bytes * q_dim)
            self.add("attention softmax (fp32)", 4 * args.n_heads * self.setup.seq_len)
            self.add("attention probs", out_bytes * args.n_heads * self.setup.seq_len)
        else:  # flash/efficient SDPA keeps q, k, v, the output and the log-sum-exp
            self.add("q, k (roped), v", out_bytes * (q_dim + 2 * kv_dim))
            self.add("attention output", out_bytes * q_dim)
            self.add("attention logsumexp (fp32)", 4 * args.n_heads)

    def _mlp(self, normed_needs_grad: bool) -> bool:
        """The input projection(s) (their input kept by ``block_inputs``) -> the activation
        -> the output projection; whether its output requires grad."""
        inputs, out = self.names.mlp_inputs, self.names.mlp_output
        for name in inputs:
            self.adapter(name)
        # gate and up, each from its projection or both from a fused one; or fc_in
        needs_grad = [self.needs_grad(name, normed_needs_grad)
                      for name in self.block.sources(inputs)]
        if self.block.gated:
            hidden_needs_grad = self._gated(*needs_grad)
        else:
            hidden_needs_grad = self._gelu(*needs_grad)
        self.linear_inputs(f"{out} input", self.args.ffn_dim, hidden_needs_grad, [out],
                           self.matmul_bytes, "heads")
        self.adapter(out)
        return self.needs_grad(out, hidden_needs_grad)

    def _gated(self, gate: bool, up: bool) -> bool:
        """act(gate) * up (silu or gelu_tanh): the activation keeps its input, the product
        each factor for the other's gradient."""
        ffn_bytes = self.matmul_bytes * self.args.ffn_dim
        if gate:
            self.add("gate output (silu input)", ffn_bytes)
        if up:
            self.add("silu output", ffn_bytes)
        if gate:
            self.add("up output", ffn_bytes)
        return gate or up

    def _gelu(self, fc_in: bool) -> bool:
        """gelu_tanh(fc_in(x)) keeps its input (the bias added: addmm's output)."""
        if fc_in:
            self.add("gelu input", self.matmul_bytes * self.args.ffn_dim)
        return fc_in


def per_device(terms: list[Term], setup: Setup) -> float:
    """Bytes per token on one device: tensor parallelism divides the head-split terms,
    and the sequence-split ones with sequence parallelism."""
    total = 0.0
    for term in terms:
        if term.split == "heads" or (term.split == "seq" and setup.sequence_parallel):
            total += term.bytes / setup.tp
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


def activation_model(setup: Setup) -> Activations:
    """Walks the first block (its input requires grad only if the embedding trains), a
    later one, and the final norm and head; then the loss head and the backward buffers."""
    args, walker = setup.args, _BlockWalk(setup)
    first_terms, output_needs_grad = walker.walk(setup.trainable.embedding)
    other_terms = walker.walk(True)[0] if args.n_layers > 1 else first_terms
    if args.n_layers > 1:
        # every later block sees a residual stream that requires grad once anything trains
        output_needs_grad = True
    mlp_out = walker.names.mlp_output
    mlp_out_input = [t for t in other_terms if t.name.startswith(mlp_out)]
    return Activations(first_layer=per_device(first_terms, setup),
                       other_layers=per_device(other_terms, setup),
                       first_terms=first_terms, other_terms=other_terms,
                       layer_input=walker.residual_bytes * _dim_per_device(setup),
                       head_inputs=per_device(_head_terms(setup, output_needs_grad), setup),
                       # loss parallel: the logits are split over the vocabulary
                       logits=walker.matmul_bytes * args.vocab_size / setup.tp,
                       log_softmax=4 * args.vocab_size / setup.tp,
                       batch_inputs=BATCH_BYTES_PER_TOKEN,
                       backward_buffers=_backward_buffers(setup, walker),
                       freed_mlp_out_input=per_device(mlp_out_input, setup),
                       input_is_saved=walker.keeps_block_input())


def _head_terms(setup: Setup, input_needs_grad: bool) -> list[Term]:
    """The final norm, and the output layer's input when the head trains (a bf16 copy
    under autocast)."""
    head = _BlockWalk(setup)
    head.norm("final norm", input_needs_grad)
    if setup.trainable.head:
        nbytes = (2 if head.cast else head.residual_bytes) * setup.args.dim
        head.add("output-layer input", nbytes, "none")
    return head.terms


def _backward_buffers(setup: Setup, walker: _BlockWalk) -> float:
    """The peak inside a block's backward, beside the incoming residual gradient: at the
    MLP's activation, with its hidden gradients alive (SwiGLU's silu(g) * u: d(m),
    d(silu(g)) and d(u); GELU: d(gelu(h)) and d(h)) and the output projection's saved
    input just freed. A checkpointed block recomputed with a LoRA adapter on the MLP's
    last input projection may peak before, at that adapter's sum: the base output, the
    update and the scaled update, three f-sized tensors beside the saved ones."""
    hidden = (3 if walker.block.gated else 2) * setup.args.ffn_dim
    last_input = walker.names.mlp_inputs[-1]
    # (selective checkpointing recomputes block 0, so some block is recomputed)
    if setup.checkpointing != "none" and setup.trainable.rank(last_input):
        # the adapter's sum spans the projection's whole output (a fused gate_up: 2 f)
        hidden = max(hidden, 3 * walker.block.shapes[last_input][1])
    return (walker.residual_bytes * _dim_per_device(setup)
            + walker.matmul_bytes * hidden / setup.tp)


def _dim_per_device(setup: Setup) -> float:
    """The residual stream's width on one device: sequence parallelism splits it over tp."""
    return setup.args.dim / (setup.tp if setup.sequence_parallel else 1)


def in_flight(setup: Setup, stage: int) -> float:
    """Micro-batches whose activations stage ``stage`` holds at once (Korthikanti et al.
    sec. 4.2: 1F1B keeps p - stage on stage ``stage``; interleaving adds (p-1)/(p v))."""
    stages, microbatches = setup.pp, max(setup.microbatches, 1)
    if stages == 1:
        return 1.0
    if setup.pp_schedule == "gpipe":
        return float(microbatches)
    held = min(stages - stage, microbatches)
    if setup.pp_schedule == "interleaved_1f1b" and setup.pp_virtual_stages > 1:
        held *= 1 + (stages - 1) / (stages * setup.pp_virtual_stages)
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

    @property
    def at_forward_end(self) -> float:
        return self.blocks + self.head + self.stage_input + self.pending_heads

    @property
    def at_last_block(self) -> float:
        return (self.blocks + self.recomputed_last_block + self.stage_input
                - self.freed_mlp_out_input + self.pending_heads)

    @property
    def at_first_block(self) -> float:
        return (self.blocks_at_first_block + self.recomputed_first_block + self.stage_input
                - self.freed_mlp_out_input + self.pending_heads)


def stage_activations(setup: Setup, act: Activations, stage: int) -> StageActivations:
    """A checkpointed block keeps its input until its backward, which recomputes the rest,
    one block at a time; another keeps every saved tensor (``kept_by_block``). Pipeline
    parallelism multiplies a stage's blocks by the micro-batches in flight
    (``in_flight``): when one reaches its first block in backward, the others still hold
    theirs."""
    ids, first, last = stage_layer_ids(setup, stage), stage == 0, stage == setup.pp - 1
    held = in_flight(setup, stage)
    kept = [kept_by_block(setup, act, i) for i in ids]
    blocks, blocks_at_first_block = held * sum(kept), kept[0] + (held - 1) * sum(kept)
    host = 0.0
    if setup.activation_offload:
        # On the device: the block whose tensors are being copied out (forward) or back
        # ahead of use (backward), and the one computing; the others wait on the host.
        moved = sum(offloaded_per_layer(setup, act, setup.checkpointed(i)) for i in ids[:-2])
        host = held * moved
        blocks -= host
        blocks_at_first_block -= (held - 1) * moved
    bf16_logits = compute_bytes(setup) == 2
    pending = (held - 1) * (act.head_inputs + act.logits + act.log_softmax) if last else 0.0
    return StageActivations(
        pending_heads=pending,
        host=host, blocks=blocks, blocks_at_first_block=blocks_at_first_block,
        recomputed_last_block=recomputed_by_block(setup, act, ids[-1]),
        recomputed_first_block=recomputed_by_block(setup, act, ids[0]),
        # a later stage receives its input activations
        stage_input=act.batch_inputs * held if first else held * act.layer_input,
        head=act.head_inputs if last else 0.0, logits=act.logits if last else 0.0,
        log_softmax=act.log_softmax if last else 0.0,
        fp32_logits=4 * setup.args.vocab_size / setup.tp if bf16_logits and last else 0,
        backward_buffers=act.backward_buffers, freed_mlp_out_input=act.freed_mlp_out_input)


def kept_by_block(setup: Setup, act: Activations, layer_id: int) -> float:
    """Bytes per token block ``layer_id`` keeps from its forward to its backward: its
    input when checkpointed, else every tensor it saves (block 0 saves less when its
    input, the embedding's output, does not require grad)."""
    if setup.checkpointed(layer_id):
        return act.layer_input
    return act.first_layer if layer_id == 0 else act.other_layers


def recomputed_by_block(setup: Setup, act: Activations, layer_id: int) -> float:
    """What recomputing block ``layer_id`` in backward adds beside the input it kept (the
    block's first norm keeps that input itself when it saves its input as is)."""
    if not setup.checkpointed(layer_id):
        return 0.0
    return act.other_layers - (act.layer_input if act.input_is_saved else 0.0)


def offloaded_per_layer(setup: Setup, act: Activations, checkpointed: bool) -> float:
    """Bytes per token of one block's saved tensors that activation offload moves: of a
    checkpointed block the input it keeps, of another every saved tensor of at least
    ``MIN_OFFLOAD_BYTES`` for a micro-batch (``parallel/offload.py``'s rule; smaller ones
    stay, as do weights, which are not activations here)."""
    tokens = setup.micro_batch * setup.seq_len
    sizes = ([act.layer_input] if checkpointed
             else [per_device([t], setup) for t in act.other_terms])
    return sum(b for b in sizes if b * tokens >= MIN_OFFLOAD_BYTES)


def loss_chunk_tokens(setup: Setup) -> int:
    """Tokens whose logits exist at once: train.loss_chunk_tokens makes (and recomputes
    in backward) one chunk's logits at a time; else the whole micro-batch's."""
    tokens = setup.micro_batch * setup.seq_len
    return min(setup.loss_chunk_tokens, tokens) if setup.loss_chunk_tokens else tokens
