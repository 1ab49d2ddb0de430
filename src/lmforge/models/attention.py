"""The one attention path every family's block takes (``attend``), and the mask of a
packed batch (``DocumentMask``).

A packed batch (``data.pack``, ``data.document_mask``) carries each position's document
id; no token may attend to another document. ``model.attention`` says how that rule is
applied:

* ``sdpa`` (the default): a dense boolean mask (batch, 1, seq, seq) given to
  ``scaled_dot_product_attention``, which then leaves the flash kernel: memory and time
  grow with seq^2 per head;
* ``flex``: FlexAttention (``torch.nn.attention.flex_attention``) with a block mask built
  once per batch (and sliding window) from the documents, the causal rule and the window;
  blocks no query may see are skipped. Compiled, as FlexAttention needs to be fast.

Without a document mask, causal attention is SDPA's ``is_causal`` fast path whatever
``model.attention`` says; a sliding window (Mistral, Gemma 3's local layers) is a mask of
its own, dense for sdpa, a block mask for flex. A KV cache (generation) always takes SDPA, with a ``DecodeMask``: the decoder's rows are
left-padded, so each row's keys start at a column of its own.
PyTorch's FlexAttention has no backward on the CPU: there, flex is for scoring only, and
training with it is refused (``models.presets`` checks the job). gpt-oss's attention sinks
(a learned logit per head in every softmax's denominator) take the SDPA path whatever the
mask (``_sink_key``); under flex they are refused.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

ATTENTION_KINDS = ("sdpa", "flex")
COMPILE_BLOCK_MASKS = True  # (the CPU tests turn it off: compiling costs seconds per shape)


class DocumentMask:
    """Causal attention within each document of a packed batch: ``segments`` (batch, seq)
    holds each position's document id (None: one document per row, which under flex
    still gives a sliding window its block mask). ``kind``: how ``attend`` applies it
    (``model.attention``). The dense and the block forms are built on first use and
    kept, so the layers of one forward share them."""

    def __init__(self, segments: Optional[torch.Tensor] = None, kind: str = "sdpa"):
        if kind not in ATTENTION_KINDS:
            raise ValueError(f"model.attention: {kind!r} is not one of "
                             f"{', '.join(ATTENTION_KINDS)}")
        self.segments, self.kind = segments, kind
        self._built: dict = {}

    def to(self, device, non_blocking: bool = False) -> "DocumentMask":
        if self.segments is None:
            return self
        return DocumentMask(self.segments.to(device, non_blocking=non_blocking), self.kind)

    def using(self, kind: str) -> "DocumentMask":
        """The same documents, applied by ``kind``."""
        return self if kind == self.kind else DocumentMask(self.segments, kind)

    def tensors(self) -> list[torch.Tensor]:
        """The segments and the dense masks built so far (every layer's inputs)."""
        built = [t for t in self._built.values() if isinstance(t, torch.Tensor)]
        return ([self.segments] if self.segments is not None else []) + built

    def causal_only(self, window: Optional[int], seq: int) -> bool:
        """Whether this is plain causal attention (SDPA's fast path applies)."""
        return self.segments is None and (window is None or seq <= window)

    def dense(self, window: Optional[int], batch: int, seq: int, device) -> torch.Tensor:
        """(batch or 1, 1, seq, seq) bool, True = may attend."""
        key = ("dense", window, batch, seq)
        if key not in self._built:
            self._built[key] = allowed_keys(torch.arange(seq, device=device), seq, window,
                                            self.segments)
        return self._built[key]

    def block_mask(self, window: Optional[int], batch: int, seq: int, device):
        """FlexAttention's ``BlockMask`` of the same rule."""
        key = ("block", window, batch, seq)
        if key not in self._built:
            from torch.nn.attention.flex_attention import create_block_mask  # (flex only)

            rows = batch if self.segments is not None else None  # None: every row alike
            # (compiled: evaluated block by block, never as a seq x seq grid)
            self._built[key] = create_block_mask(_mask_mod(self.segments, window), rows,
                                                 None, seq, seq, device=device,
                                                 _compile=COMPILE_BLOCK_MASKS)
        return self._built[key]


class DecodeMask:
    """The mask of batched decoding (``models/generate.py``): the rows are left-padded, so
    row b's tokens fill the cache from column ``start[b]`` on, and the queries of this
    forward sit at cache columns ``columns`` (seq,), the same for every row. A query sees
    the keys of its own row up to its own column (within a window, if any); a padding
    query sees only itself, so no row of the softmax is empty (which would give NaN, and
    NaN times a zero weight is still NaN in a real query's sum). Tensors only, no host
    values: one compiled decode step serves every position."""

    def __init__(self, start: torch.Tensor, columns: torch.Tensor,
                 real: Optional[int] = None):
        self.start, self.columns = start, columns  # (batch,), (seq,)
        # Only the first ``real`` columns hold tokens, the rest a sequence-parallel
        # step's fillers (``models.decode_parallel.sharded_step``); None: every column.
        # Attention needs no telling (a later step overwrites a filler's keys before any
        # query sees them), a recurrent state does (``models.gated_deltanet``).
        self.real = real
        self._built: dict = {}

    def valid(self) -> torch.Tensor:
        """(batch, seq) bool: which of this forward's positions are a row's tokens, not
        its left padding nor a filler."""
        valid = self.columns[None, :] >= self.start[:, None]
        if self.real is not None:
            valid = valid & (torch.arange(len(self.columns), device=valid.device) < self.real)
        return valid

    def memo(self, key, make):
        """``make()`` once per forward (one DecodeMask per step), shared by the layers."""
        if key not in self._built:
            self._built[key] = make()
        return self._built[key]

    def dense(self, window: Optional[int], keys: int) -> torch.Tensor:
        """(batch, 1, seq, keys) bool, True = may attend; built once per window."""
        if (window, keys) not in self._built:
            k = torch.arange(keys, device=self.columns.device)[None, None, :]  # (1, 1, keys)
            q = self.columns[None, :, None]  # (1, seq, 1)
            allowed = (k >= self.start[:, None, None]) & (k <= q)  # (batch, seq, keys)
            if window is not None:
                allowed &= k > q - window
            self._built[(window, keys)] = (allowed | (k == q))[:, None]
        return self._built[(window, keys)]


def per_forward(mask, key, make):
    """``make()`` (rotary tables from the positions), computed once per decoder step and
    shared by every layer when the mask is a ``DecodeMask``; else once per call."""
    return mask.memo(key, make) if isinstance(mask, DecodeMask) else make()


class ContextParallel:
    """This rank's part of each sequence under context parallelism (``parallel.cp``):
    ``index`` (local,) holds the global positions of its rows' local tokens, in order
    (two chunks of each sequence: one from the front, one from the back, so the causal
    work is balanced), ``segments`` (batch, seq) the documents of the whole rows, or None.
    ``attend`` gathers every rank's keys and values (an autograd all-gather over
    ``group``, whose backward sends each rank the gradients of its own), puts them in
    sequence order, and attends from the local queries with the global rule: causal,
    within a document and a window, by global position."""

    def __init__(self, index: torch.Tensor, seq: int, group, segments=None):
        self.index, self.seq, self.group, self.segments = index, seq, group, segments
        self._order: Optional[torch.Tensor] = None
        self._dense: dict = {}

    def to(self, device, non_blocking: bool = False) -> "ContextParallel":
        move = (lambda t: None if t is None else t.to(device, non_blocking=non_blocking))
        return ContextParallel(move(self.index), self.seq, self.group, move(self.segments))

    def tensors(self) -> list[torch.Tensor]:
        """What every layer reads: the index, the documents, the masks built so far."""
        return [t for t in (self.index, self.segments, *self._dense.values())
                if t is not None]

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """(batch, heads, local, hd) on every rank -> (batch, heads, seq, hd), in order."""
        parts = _GatherSequence.apply(t, self.group)  # (batch, heads, cp x local, hd)
        if self._order is None:  # where each global position sits in ``parts``
            everyone = [torch.empty_like(self.index) for _ in range(dist.get_world_size(
                self.group))]
            dist.all_gather(everyone, self.index, group=self.group)
            self._order = torch.argsort(torch.cat(everyone))
        return parts.index_select(2, self._order)

    def dense(self, window: Optional[int], device) -> torch.Tensor:
        """(batch or 1, 1, local, seq) bool: may local query i see global key j?"""
        if window not in self._dense:
            self._dense[window] = allowed_keys(self.index.to(device), self.seq, window,
                                               self.segments)
        return self._dense[window]


def allowed_keys(queries: torch.Tensor, seq: int, window: Optional[int],
                 segments: Optional[torch.Tensor]) -> torch.Tensor:
    """(batch or 1, 1, len(queries), seq) bool: may the query at each global position in
    ``queries`` see key j (causal, within ``window`` keys, within its document of
    ``segments`` (batch, seq))? Comparisons go straight to bool: no (queries, seq)
    integer intermediate, which at long sequences would be 8x the mask."""
    keys = torch.arange(seq, device=queries.device)[None, :]
    allowed = keys <= queries[:, None]
    if window is not None:
        allowed &= keys > queries[:, None] - window
    if segments is None:
        return allowed[None, None]
    same = segments[:, queries][:, :, None] == segments[:, None, :]
    return (same & allowed)[:, None]


class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence (dim 2) over ``group``; backward gives each rank the
    sum over the group of the gradients of its own part: a reduce-scatter (NCCL), or an
    all-reduce then this rank's slice (gloo, which has no reduce-scatter; torch's own
    autograd all-gather addresses a subgroup's ranks by their global ranks there)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        group = ctx.group
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        pieces = grad.chunk(n, dim=2)
        if dist.get_backend(group) == dist.Backend.NCCL:
            mine = torch.empty_like(pieces[0], memory_format=torch.contiguous_format)
            dist.reduce_scatter_tensor(mine, torch.stack(pieces).contiguous(), group=group)
            return mine, None
        total = grad.contiguous()
        dist.all_reduce(total, group=group)
        return total.chunk(n, dim=2)[rank].contiguous(), None


def _mask_mod(segments: Optional[torch.Tensor], window: Optional[int]):
    """FlexAttention's mask function: may query ``q`` of row ``b`` see key ``k``?"""
    def allowed(b, h, q, k):
        ok = k <= q
        if window is not None:
            ok = ok & (q - k < window)
        if segments is not None:
            ok = ok & (segments[b, q] == segments[b, k])
        return ok
    return allowed


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None, *, past: int = 0,
           window: Optional[int] = None, scale: Optional[float] = None,
           sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention of ``q`` (batch, heads, seq, head_dim) over ``k``, ``v`` (batch, kv heads,
    past + seq, head_dim; fewer kv heads: grouped-query attention), causal, within
    ``window`` keys (the query's own included, as transformers counts it) and within
    each document of a ``DocumentMask``; or an explicit boolean ``mask`` (True = may
    attend). ``scale`` defaults to 1 / sqrt(head_dim). ``sinks`` (heads,): gpt-oss's
    learned logit per head that joins every softmax's denominator (``_sink_key``).
    Returns (batch, heads, seq, hd)."""
    batch, seq, gqa = q.shape[0], q.shape[2], q.shape[1] != k.shape[1]
    if isinstance(mask, DecodeMask):
        return _sdpa(q, k, v, mask.dense(window, k.shape[2]), False, scale, sinks)
    if isinstance(mask, ContextParallel):
        k, v = mask.gather(k), mask.gather(v)
        return _sdpa(q, k, v, mask.dense(window, q.device), False, scale, sinks)
    if isinstance(mask, DocumentMask) and past:
        raise ValueError("a DocumentMask is for a packed batch, not a KV cache")
    if isinstance(mask, DocumentMask):
        if mask.causal_only(window, seq):
            mask = None
        elif mask.kind == "flex":
            if sinks is not None:
                raise ValueError("model.attention: 'flex' has no attention sinks (gpt-oss); "
                                 "use 'sdpa'")
            return _flex()(q, k, v, block_mask=mask.block_mask(window, batch, seq, q.device),
                           scale=scale, enable_gqa=gqa)
        else:
            mask = mask.dense(window, batch, seq, q.device)
    else:
        mask = sliding_window_mask(mask, seq, past, window, q.device)
    if mask is None and past > 0 and seq > 1:
        mask = causal_mask(seq, past, q.device)
    return _sdpa(q, k, v, mask, mask is None and past == 0, scale, sinks)


def _sdpa(q, k, v, mask, causal: bool, scale: Optional[float],
          sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """SDPA, grouped-query where k and v have fewer heads. On CUDA no fused kernel takes
    a mask with grouped heads (flash takes no mask, the memory-efficient kernel no
    grouping), and SDPA would fall back to its math path, which keeps every score
    (seq x seq per head): there k and v are repeated to every head instead, for the
    memory-efficient kernel. The CPU's kernel takes both as they are."""
    if sinks is not None:
        k, v, mask = _sink_key(q, k, v, mask, causal, sinks)
        causal = False
    gqa = q.shape[1] != k.shape[1]
    if gqa and mask is not None and q.is_cuda:
        k, v = repeat_heads(k, q.shape[1]), repeat_heads(v, q.shape[1])
        gqa = False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                          scale=scale, enable_gqa=gqa)


def _sink_key(q, k, v, mask, causal: bool, sinks: torch.Tensor):
    """k and v with one more key, of zero value, that every query may see and whose score
    is its head's sink: a float mask (0 allowed, -inf not) gives it that score, as a key
    of zeros scores zero. The sink takes its share of each softmax and adds nothing to
    the output (gpt-oss). The mask becomes per head and dense, so the flash path is lost:
    (mask rows, heads, seq, keys + 1)."""
    batch, heads, seq = q.shape[:3]
    keys = k.shape[2]
    if mask is None:  # causal, or every key (one query over a cache)
        mask = (causal_mask(seq, keys - seq, q.device) if causal
                else torch.ones(seq, keys, dtype=torch.bool, device=q.device))
    mask = mask if mask.dim() == 4 else mask[None, None]  # (rows, 1 or heads, seq, keys)
    rows = mask.shape[0]
    bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(
        ~mask, float("-inf")).expand(rows, heads, seq, keys)
    sink = sinks.to(q.dtype).view(1, heads, 1, 1).expand(rows, heads, seq, 1)
    k = torch.cat((k, k.new_zeros(batch, k.shape[1], 1, k.shape[3])), 2)  # (b, kv, keys + 1, hd)
    v = torch.cat((v, v.new_zeros(batch, v.shape[1], 1, v.shape[3])), 2)  # (b, kv, keys + 1, hd)
    return k, v, torch.cat((bias, sink), dim=-1)  # (rows, heads, seq, keys + 1)


def repeat_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(batch, kv heads, seq, hd) -> (batch, heads, seq, hd): each kv head repeated for
    the query heads of its group, in order (as enable_gqa pairs them)."""
    return t.repeat_interleave(heads // t.shape[1], dim=1)


# The fewest features per head that compiled flex takes on CUDA (torch 2.11's Triton
# kernel refuses fewer, seen on an H200); job.resolve refuses such a run before it starts.
FLEX_MIN_HEAD_DIM = 16


@functools.cache
def _flex():
    """FlexAttention, compiled once per process (uncompiled it materialises every score,
    which is what it is meant to avoid)."""
    from torch.nn.attention.flex_attention import flex_attention  # (flex only)

    return torch.compile(flex_attention, dynamic=False)


def causal_mask(seq: int, past: int, device) -> torch.Tensor:
    """(seq, past + seq) boolean mask: query i sees keys up to past + i."""
    q_pos = torch.arange(past, past + seq, device=device)[:, None]
    k_pos = torch.arange(past + seq, device=device)[None, :]
    return k_pos <= q_pos


def sliding_window_mask(mask: Optional[torch.Tensor], seq: int, past: int,
                        window: Optional[int], device) -> Optional[torch.Tensor]:
    """``mask`` narrowed so query i sees keys j with i - window < j <= i (transformers'
    sliding-window mask: the window counts the query itself). Unchanged, keeping SDPA's
    fast causal path, when no query has more than ``window`` keys."""
    if window is None or past + seq <= window:
        return mask
    q_pos = torch.arange(past, past + seq, device=device)[:, None]
    k_pos = torch.arange(past + seq, device=device)[None, :]
    window_mask = (k_pos <= q_pos) & (k_pos > q_pos - window)  # (seq, past + seq)
    return window_mask if mask is None else mask & window_mask
