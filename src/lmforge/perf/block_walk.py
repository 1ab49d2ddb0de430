"""One block walked op by op the way autograd sees it (docs/estimate.md, "Activations of
one block"): what each op keeps for backward, per token, in the dtypes the run computes
in, as the family's ``BlockSpec`` describes the block: Llama's sequential block, GPT-J's
parallel one, fused projections (Phi-3), post-norms and (1 + w) norms (Gemma 3)."""
from __future__ import annotations

from dataclasses import dataclass

from lmforge.models.registry import family_of
from lmforge.perf import linear_attention
from lmforge.perf.estimate_setup import (Setup, adapter_bytes, compute_bytes, linear_lora_key,
                                         residual_bytes)
from lmforge.perf.masks import dense_masks
from lmforge.perf.mla import latent_attention
from lmforge.perf.mla_walk import walk_mla
from lmforge.perf.moe_walk import walk_moe


@dataclass
class Term:
    """Bytes per token of one tensor kept for backward. ``split``: how tensor parallelism
    divides it: "heads" (always by tp), "seq" (by tp with sequence parallelism), "none"."""
    name: str
    bytes: float
    split: str = "heads"


class BlockWalk:
    """Walks one block the way autograd sees it, collecting the terms it saves.

    ``residual_bytes`` is R and ``matmul_bytes`` C of docs/estimate.md; ``cast``: autocast
    copies fp32 activations to bf16 at every matmul."""

    def __init__(self, setup: Setup):
        self.setup, self.args, self.trainable = setup, setup.args, setup.trainable
        self.family = family_of(setup.args)
        self.names = self.family.projections
        self.block = self.family.block(setup.args)
        self.mla = latent_attention(setup.args)  # DeepSeek-V3's latent attention, or None
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

    def walk(self, input_needs_grad: bool, sparse: bool = False, linear: bool = False
             ) -> tuple[list[Term], bool]:
        """The terms one block saves (``sparse``: an MoE layer's; ``linear``: one whose
        attention is a linear-attention layer), and whether its output requires grad."""
        self.terms = []
        qkv, mlp_inputs = self.attention_inputs, self.names.mlp_inputs
        normed_needs_grad = self.norm("attention norm", input_needs_grad)
        if linear:
            attention_needs_grad = self._linear_attention(normed_needs_grad)
            return self._after_attention(input_needs_grad, attention_needs_grad, sparse)
        if self.block.parallel:  # x + attention(norm(x)) + mlp(norm(x))
            self._parallel_block_inputs(normed_needs_grad)
            attention_needs_grad = self._attention(normed_needs_grad)
            mlp_needs_grad = self._mlp(normed_needs_grad)
            return list(self.terms), input_needs_grad or attention_needs_grad or mlp_needs_grad
        self.block_inputs(qkv, normed_needs_grad)
        attention_needs_grad = self._post_norm("post-attention norm",
                                               self._attention(normed_needs_grad))
        return self._after_attention(input_needs_grad, attention_needs_grad, sparse)

    def _after_attention(self, input_needs_grad: bool, attention_needs_grad: bool,
                         sparse: bool) -> tuple[list[Term], bool]:
        """The residual add, the MLP's norm and the MLP (or an MoE) after attention."""
        mlp_inputs = self.names.mlp_inputs
        hidden_needs_grad = input_needs_grad or attention_needs_grad  # h = x + attention
        ffn_normed_needs_grad = self.norm("ffn norm", hidden_needs_grad)
        if sparse:
            mlp_needs_grad = walk_moe(self, ffn_normed_needs_grad)
        else:
            self.block_inputs(mlp_inputs, ffn_normed_needs_grad)
            mlp_needs_grad = self._mlp(ffn_normed_needs_grad)
        mlp_needs_grad = self._post_norm("post-MLP norm", mlp_needs_grad)
        return list(self.terms), hidden_needs_grad or mlp_needs_grad

    def _linear_attention(self, normed_needs_grad: bool) -> bool:
        """A Gated DeltaNet in place of attention: what it saves, its input's copies
        included, counted on fake tensors (``perf/linear_attention.py``); whether its
        output requires grad."""
        names = linear_attention.LINEAR_PROJECTIONS
        trained = tuple(n for n in names if self.trainable.trains(n) or self.trainable.rank(n))
        others = self.trainable.norms
        # (this tensor-parallel rank's heads: a count per device, split no further)
        saved = linear_attention.saved_bytes_per_token(
            self.args, self.setup.layout.tp, self.setup.micro_batch, self.setup.local_seq,
            self.residual_bytes, self.autocast, normed_needs_grad, trained, others,
            linear_lora_key(self.setup))
        self.add("gated deltanet (its input, projections and chunked rule; fake-tensor count)",
                 saved, "none")
        return normed_needs_grad or bool(trained) or others

    @property
    def attention_inputs(self) -> tuple[str, ...]:
        """The projections that read the attention's normalised input: q, k and v (or a
        fused qkv), or MLA's query and latent projections."""
        return self.mla.inputs if self.mla is not None else self.names.attention[:-1]

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
        qkv, mlp_inputs = self.attention_inputs, self.names.mlp_inputs
        if self.setup.cfg.parallel.sequence_parallel and self.setup.layout.tp > 1:
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
        if self.mla is not None:
            return walk_mla(self, self.mla, normed_needs_grad)
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
        if self._output_gate():  # out * sigmoid(gate) (Qwen3.5): the sigmoid keeps its
            # output, the product its other factor (the attention's output, a copy in
            # (batch, seq, heads x head_dim)); the product is the output projection's input
            self.add("output gate sigmoid", self.matmul_bytes * q_dim)
            self.add("gated attention output", self.matmul_bytes * q_dim)
            is_view = False
        self.linear_inputs(f"{out} input", q_dim, scores_need_grad, [out],
                           self.matmul_bytes, "heads", counted=is_view)
        self.adapter(out)
        return self.needs_grad(out, scores_need_grad)

    def _output_gate(self) -> bool:
        """The query projection also yields a per-head output gate (its rows twice the
        queries': Qwen3.5's gated attention)."""
        q = self.names.attention[0]
        n_out = self.block.shapes.get(q, (0, 0))[1]
        return n_out == 2 * self.args.n_heads * self.args.head_dim

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
        if self._output_gate() and q_needs_grad and c == 4:  # (fp32: x.float() is the
            # view of q_proj's output it was given, which keeps the gate's rows too)
            self.add("q norm input's gate rows (q_proj's output)", 4 * args.n_heads
                     * args.head_dim)
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
        """What attention keeps per query token. Under context parallelism each local
        query's keys are the whole sequence's, gathered from the cp ranks: the gathered k
        and v (cp key positions per local token) are what SDPA keeps, not the local ones."""
        args, out_bytes, setup = self.args, self.matmul_bytes, self.setup
        q_dim, kv_dim = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        keys, seq = setup.layout.cp, setup.batch.seq_len
        if setup.attention == "eager":  # HF eager: k/v repeated, S x S kept twice
            self.add("q (roped)", out_bytes * q_dim)
            self.add("k, v repeated to all heads", 2 * out_bytes * q_dim * keys)
            self.add("attention softmax (fp32)", 4 * args.n_heads * seq)
            self.add("attention probs", out_bytes * args.n_heads * seq)
            return
        # flash/efficient SDPA keeps q, k, v, the output and the log-sum-exp
        masks = dense_masks(setup)
        if setup.device == "cuda":  # masked layers: k and v repeated to every head
            kv_dim += masks.share * (q_dim - kv_dim)
        self.add("q (roped)", out_bytes * q_dim)
        self.add("k (roped), v" + (" gathered over cp" if keys > 1 else ""),
                 2 * out_bytes * kv_dim * keys)
        self.add("attention output", out_bytes * q_dim)
        self.add("attention logsumexp (fp32)", 4 * args.n_heads)
        if setup.device != "cuda":
            self.add("attention mask (the query's dtype)", masks.copy_bytes(out_bytes), "none")

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
