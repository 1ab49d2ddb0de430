"""What an MoE layer's feed-forward keeps for backward, per token (docs/estimate.md,
"Mixture of experts"), walked as ``models/moe.py`` runs it: the router's fp32 linear and
softmax, the top_k choice and its renormalisation; each token's top_k (token, expert)
assignments sorted by expert, its rows gathered (x[tokens]: top_k rows per token), one
grouped product per stacked weight (gate_up, then down), SwiGLU, the routing weights,
index_add back; the shared experts; and, outside the block, the load-balancing loss's
softmax over the same logits, which the trainer computes after the forward."""
from __future__ import annotations

from typing import Any

from lmforge.perf.flops import ROUTER, SHARED_EXPERTS

BlockWalk = Any  # perf.block_walk.BlockWalk, which calls walk_moe

INDEX_BYTES = 8  # int64 indices
# Expert parallelism: the rows a rank receives, as a multiple of the balanced share (top_k
# per token of its own micro-batch). The load-balancing loss keeps the routing near
# balance but not at it: the estimate allows the busiest rank a quarter more (a capacity
# factor of 1.25, as GShard's and Switch's are set), capped by what routing can send it
# (each token at most min(top_k, n_experts / ep) of its experts, from each of ep ranks).
EP_IMBALANCE = 1.25


def arrived_share(setup, moe) -> float:
    """The rows an expert-parallel rank computes per top_k of its own tokens: 1 without
    ep, else ``EP_IMBALANCE`` capped by the routing's bound."""
    ep = setup.ep
    if ep == 1:
        return 1.0
    return min(EP_IMBALANCE, ep * min(moe.top_k, moe.n_experts // ep) / moe.top_k)
EXPERTS_FIRST = "expert assignments' tokens (int64)"  # the first term after the routing


def walk_moe(walk: BlockWalk, normed_needs_grad: bool) -> bool:
    """Adds the MoE's terms to ``walk``; returns whether its output requires grad."""
    moe, tr = walk.block.moe, walk.trainable
    d, k, c = moe.dim, moe.top_k, walk.matmul_bytes
    shared = shared_width(moe)
    # the norm's output, x: its fp32 weight times y makes it fp32 even when the stream is
    # bf16 (a frozen bf16 base under autocast); read by the router (and the shared
    # experts' gate and up)
    x_bytes = max(walk.residual_bytes, walk.adapter_bytes)
    consumers = [ROUTER] + [SHARED_EXPERTS] * 2 * (shared > 0)
    walk.linear_inputs("router input", d, normed_needs_grad, consumers, x_bytes)
    logits = normed_needs_grad or tr.trains(ROUTER)
    if logits:
        _routing(walk, moe)
    gate_up, down = walk.names.experts
    hidden = walk.needs_grad(gate_up, normed_needs_grad)
    # x[tokens] keeps the token of each assignment (index_add reads the same tensor)
    if normed_needs_grad or hidden:
        walk.add(EXPERTS_FIRST, INDEX_BYTES * k, "none")
    # the experts' rows: this rank's own under ep = 1, else those the all-to-all brought
    arrived = k * arrived_share(walk.setup, moe)
    if walk.setup.ep > 1 and (normed_needs_grad or hidden):
        # the arrived rows' regrouping by local expert and its inverse (int64 each)
        walk.add("arrived rows' regrouping and its inverse (int64, ep)",
                 2 * INDEX_BYTES * arrived, "none")
    if tr.trains(gate_up) or tr.rank(gate_up):  # the grouped product's weight gradient
        walk.add("gathered rows (gate_up input)", c * arrived * d, "none")
    if hidden:  # silu(gate) keeps h (gate and up are its halves), the product silu(gate)
        walk.add("experts' gate_up output (silu input, up)", c * arrived * 2 * moe.ffn_dim)
        walk.add("experts' silu output", c * arrived * moe.ffn_dim)
    if tr.trains(down) or tr.rank(down):
        walk.add("experts' down input", c * arrived * moe.ffn_dim)
    routed = walk.needs_grad(down, hidden)
    if logits and routed:  # y * weight keeps both: y, the gathered weights and their order
        walk.add("experts' outputs (times the routing weights)", c * k * d)
        walk.add("routing weights gathered, their order", (c + INDEX_BYTES) * k, "none")
    if logits or routed:  # index_add keeps its source (the weighted rows, x's dtype)
        walk.add("experts' weighted outputs (index_add source)", x_bytes * k * d, "none")
    if shared:
        routed = _shared_experts(walk, shared, normed_needs_grad) or routed
    return routed or logits


def _routing(walk: BlockWalk, moe) -> None:
    """softmax_topk: the softmax's output, the top_k's indices, the renormalisation's
    operands (the k weights and their sum). The router casts to fp32, but under autocast
    its linear runs in bf16 all the same, and the softmax then stays bf16 on the CPU
    (CUDA's autocast computes softmax in fp32)."""
    k = moe.top_k
    cpu_autocast = walk.autocast and walk.setup.device != "cuda"
    probs = walk.matmul_bytes if cpu_autocast else 4
    walk.add("router softmax", probs * moe.n_experts, "none")
    walk.add("router top_k indices (int64)", INDEX_BYTES * k, "none")
    if moe.norm_topk_prob:
        walk.add("router top_k weights and their sum", probs * (k + 1), "none")


def _shared_experts(walk: BlockWalk, width: int, normed_needs_grad: bool) -> bool:
    """DeepSeek-V3's shared experts, a gated MLP of ``width`` (their input is counted with
    the router's): as a dense block's SwiGLU."""
    needs_grad = walk.needs_grad(SHARED_EXPERTS, normed_needs_grad)
    c = walk.matmul_bytes
    if needs_grad:
        walk.add("shared experts' gate, silu and up outputs", 3 * c * width)
    if walk.trainable.trains(SHARED_EXPERTS):
        walk.add("shared experts' down input", c * width)
    if needs_grad and getattr(walk.block.moe, "shared_expert_gate", False):
        # Qwen's shared output * sigmoid(gate(x)): each factor kept for the other
        walk.add("shared expert output and its sigmoid gate", c * walk.args.dim + 4, "none")
    return needs_grad


def shared_width(moe) -> int:
    """The shared experts' width as one gated MLP (Qwen's shared_ffn_dim, else
    n_shared x ffn_dim; 0: none)."""
    return getattr(moe, "shared_ffn_dim", 0) or moe.n_shared_experts * moe.ffn_dim


def aux_loss_bytes(walk: BlockWalk, normed_needs_grad: bool = True) -> float:
    """Per token and MoE layer, outside the block (kept under checkpointing too): the
    load-balancing loss's softmax (fp32) of the router's logits, from the loss until the
    backward reaches it (when the logits require grad)."""
    moe = walk.block.moe
    if moe is None or not (normed_needs_grad or walk.trainable.trains(ROUTER)):
        return 0.0
    return 4.0 * moe.n_experts


def moe_backward_buffers(walk: BlockWalk, dim: float) -> float:
    """The peak inside an MoE layer's backward, at its start: the incoming gradient
    (dim), index_add's gradient gathered to the assignments (top_k rows, x's dtype), and
    the routing weights' product's two gradients (the rows' and, before its sum, the
    weights'). Under expert parallelism the combine's all-to-all then brings the rows'
    gradient to the experts' ranks: its receive buffer (the arrived rows, compute dtype)
    beside them."""
    moe = walk.block.moe
    k, c, r = moe.top_k, walk.matmul_bytes, walk.residual_bytes
    received = c * k * arrived_share(walk.setup, moe) * moe.dim if walk.setup.ep > 1 else 0.0
    return r * dim + r * k * moe.dim + 2 * c * k * moe.dim + received
