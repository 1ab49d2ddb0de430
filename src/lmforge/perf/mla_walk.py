"""What multi-head latent attention (``models/mla.py``) keeps for backward, per token
(docs/estimate.md, "Multi-head latent attention"), walked as ``MLAttention.forward``
runs: the query latent and its norm, the kv latent and its norm, kv_b's output (k_nope
and v), the rotary pieces, the concatenated q and k, SDPA's saved tensors, o_proj's
input."""
from __future__ import annotations

from typing import Any

from lmforge.perf.masks import dense_masks
from lmforge.perf.mla import KV_A, KV_B, OUT, LatentAttention

BlockWalk = Any  # perf.block_walk.BlockWalk, which calls walk_mla


def walk_mla(walk: BlockWalk, mla: LatentAttention, normed_needs_grad: bool) -> bool:
    """Adds the terms MLA saves to ``walk`` (the normalised input's copies kept by
    ``walk.block_inputs(mla.inputs)``); whether its output requires grad."""
    q = _queries(walk, mla, normed_needs_grad)
    k_rope, kv = _keys_and_values(walk, mla, normed_needs_grad)
    k, v = kv or k_rope, kv
    walk._rope(q, k_rope, walk.matmul_bytes)  # one call for q's heads, one for the key
    scores_need_grad = q or k or v
    is_view = scores_need_grad and _sdpa(walk, mla)
    walk.linear_inputs(f"{OUT} input", mla.n_heads * mla.v, scores_need_grad, [OUT],
                       walk.matmul_bytes, "heads", counted=is_view)
    walk.adapter(OUT)
    return walk.needs_grad(OUT, scores_need_grad)


def _latent_norm_out_bytes(walk: BlockWalk) -> int:
    """A latent norm's output: its weight (fp32 unless every parameter is bf16, or FSDP2
    gathers them so) times y in the compute dtype."""
    return max(walk.matmul_bytes, walk.adapter_bytes)


def _queries(walk: BlockWalk, mla: LatentAttention, normed_needs_grad: bool) -> bool:
    """q_proj, or q_a_proj -> q_a_layernorm -> q_b_proj; whether q requires grad."""
    if mla.q_lora_rank is None:
        walk.adapter("q_proj")
        return walk.needs_grad("q_proj", normed_needs_grad)
    walk.adapter("q_a_proj")
    latent = walk.needs_grad("q_a_proj", normed_needs_grad)
    normed = walk._rms_norm("q latent norm", latent, mla.q_lora_rank, 1, walk.matmul_bytes,
                            "none")
    walk.linear_inputs("q_b input", mla.q_lora_rank, normed, ["q_b_proj"],
                       _latent_norm_out_bytes(walk))
    walk.adapter("q_b_proj")
    return walk.needs_grad("q_b_proj", normed)


def _keys_and_values(walk: BlockWalk, mla: LatentAttention,
                     normed_needs_grad: bool) -> tuple[bool, bool]:
    """kv_a_proj_with_mqa -> kv_a_layernorm (on the latent) -> kv_b_proj; whether the
    rotary key and kv_b's output (k_nope and v) require grad. In fp32 the norm's
    ``x.float()`` is the latent itself, a view of kv_a's output, so it keeps all of that
    output, the rotary key's features too."""
    walk.adapter(KV_A)
    latent = walk.needs_grad(KV_A, normed_needs_grad)
    normed = walk._rms_norm("kv latent norm", latent, mla.kv_lora_rank, 1,
                            walk.matmul_bytes, "none")
    if latent and walk.matmul_bytes == 4:
        walk.add("kv latent norm input: the rotary key beside it", 4 * mla.rope, "none")
    walk.linear_inputs("kv_b input", mla.kv_lora_rank, normed, [KV_B],
                       _latent_norm_out_bytes(walk))
    walk.adapter(KV_B)
    return latent, walk.needs_grad(KV_B, normed)


def _sdpa(walk: BlockWalk, mla: LatentAttention) -> bool:
    """What attention keeps per query token; whether o_proj's input is a view of a tensor
    it keeps. q and k are concatenations, contiguous as (batch, heads, seq, qk); v a view
    of kv_b's output, whose whole storage (k_nope's part too) it keeps. The CPU's flash
    kernel writes its output in q's layout, so o_proj's input is a copy (CUDA's fused
    kernels write (batch, seq, heads, v): a view). On the CPU SDPA takes its math path
    when the key and value head dims differ (DeepSeek-V3: 192 and 128): scaled fp32
    copies of q and k, the fp32 softmax, v (an fp32 copy under autocast)."""
    setup, c, h = walk.setup, walk.matmul_bytes, mla.n_heads
    keys, seq = setup.layout.cp, setup.batch.seq_len
    v_storage = c * h * (mla.nope + mla.v) if keys == 1 else c * h * mla.v * keys
    if setup.attention == "eager":  # HF eager: the scores kept twice
        walk.add("q, k (roped)", c * h * mla.qk * (1 + keys))
        walk.add("v (kv_b output)", v_storage)
        walk.add("attention softmax (fp32)", 4 * h * seq)
        walk.add("attention probs", c * h * seq)
        return False
    if setup.device != "cuda" and mla.qk != mla.v:
        walk.add("q, k scaled (fp32, math SDPA)", 4 * h * mla.qk * (1 + keys))
        walk.add("v", v_storage if c == 4 else 4 * h * mla.v * keys)
        walk.add("attention softmax (fp32, math SDPA)", 4 * h * seq)
        return False
    walk.add("q (roped)", c * h * mla.qk)
    walk.add("k (roped)" + (" gathered over cp" if keys > 1 else ""), c * h * mla.qk * keys)
    walk.add("v (kv_b output)", v_storage)
    walk.add("attention output", c * h * mla.v)
    walk.add("attention logsumexp (fp32)", 4 * h)
    if setup.device != "cuda":
        walk.add("attention mask (the query's dtype)",
                 dense_masks(setup).copy_bytes(c), "none")
    return setup.device == "cuda"
