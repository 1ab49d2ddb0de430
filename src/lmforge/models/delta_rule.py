"""The gated delta rule (Yang, Kautz and Hatamizadeh, "Gated Delta Networks", 2024), the
recurrence inside a Gated DeltaNet layer (``models/gated_deltanet.py``), in two forms
that compute the same thing:

* ``chunk_gated_delta_rule`` (training, prefill): the sequence in chunks of C tokens. The
  C updates of a chunk are folded into one triangular solve (the UT transform), the
  chunk reads the incoming state in one product, and only the chunks are sequential.
* ``recurrent_gated_delta_rule`` (decoding): one token at a time.

Each head keeps a state S (key dim x value dim); at each token S <- exp(g) S, then
S <- S + beta k (v - S^T k)^T, and the output is S^T q * scale. A packed row's documents
(``segments``, as a ``DocumentMask`` holds them) each start from an empty state. Pure
PyTorch, in fp32: the reference, and what runs wherever FLA does not.

On a CUDA device with flash-linear-attention installed (an optional extra, ``pip install
flash-linear-attention``: Triton kernels of both forms), ``rules`` gives FLA's kernels
behind the same arguments (``FlaRules``): a packed batch's documents become FLA's
variable-length sequences (``cu_seqlens``), q and k go in v's dtype (bf16 in a bf16 run),
and FLA accumulates in fp32 inside; equal to these within bf16's tolerance
(tests/gpu/test_fla_cuda.py).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Optional

import torch
import torch.nn.functional as F

# Tokens per chunk: FLA's kernels' size, and what transformers uses.
CHUNK_SIZE = 64


# ---------------------------------------------------------------------- documents

def document_index(segments: torch.Tensor) -> torch.Tensor:
    """(batch, seq) long: each position's document, counted from 0 along its row. A
    document is a run of equal ids in ``segments``, as the data's positions count them
    (``data.dataset.positions_from_segments``)."""
    starts = segments[:, 1:] != segments[:, :-1]  # (batch, seq - 1)
    return F.pad(starts.cumsum(1), (1, 0))


def _chunk_documents(segments: Optional[torch.Tensor], seq: int, pad: int, chunk: int,
                     device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Which decays survive document boundaries, per chunk (batch or 1, 1, chunks, ...):

    * within (chunk, chunk): i and j (j <= i) are in one document, so j's write reaches i;
    * from_start (chunk,): i is in the document of the state entering the chunk (chunk 0:
      the first document, which an initial state continues);
    * to_end (chunk,): i is in the chunk's last document, so its write leaves the chunk.

    The padding after the sequence joins the last document (it writes nothing)."""
    if segments is None:
        docs = torch.zeros(1, seq, dtype=torch.long, device=device)
    else:
        docs = document_index(segments)  # (batch, seq)
    docs = torch.cat([docs, docs[:, -1:].expand(-1, pad)], 1).view(docs.shape[0], -1, chunk)
    before = torch.cat([docs[:, :1, :1], docs[:, :-1, -1:]], 1)  # (batch, chunks, 1)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=device).tril()
    within = (docs[..., :, None] == docs[..., None, :]) & causal  # (batch, chunks, c, c)
    from_start, to_end = docs == before, docs == docs[..., -1:]  # (batch, chunks, c)
    return within[:, None], from_start[:, None], to_end[:, None]


def _running_decay(g: torch.Tensor, within: Optional[torch.Tensor]) -> torch.Tensor:
    """(b, h, n, c) the log decay summed from the chunk's start through each token, or,
    with documents (``within``), from the token's own document's start in the chunk: a
    difference of two running sums that include an earlier document's decay (hundreds
    of nats) would lose digits that a Gamma within the document needs (measured: logits
    1.2e-5 of their scale off the document run alone; 2.0e-6 this way)."""
    if within is None:
        return g.cumsum(-1)
    return (within.float() @ g[..., None]).squeeze(-1)


def _decays(log_decay: torch.Tensor, within: torch.Tensor, from_start: torch.Tensor,
            to_end: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gamma(i, j) (b, h, n, c, c), Gamma(i, start) and Gamma(end, i) (b, h, n, c), zero
    across a document boundary."""
    # -inf first where j > i, whose positive exponent could overflow
    pairwise = log_decay[..., :, None] - log_decay[..., None, :]
    pairwise = pairwise.masked_fill(~within, float("-inf")).exp()
    decay_in = log_decay.exp() * from_start
    # Gamma(end, i): zero first where i's document ended inside the chunk: the end's
    # running sum restarted there, so the difference may be hundreds of nats above 0,
    # whose exp is inf (and inf * 0 a NaN state for the next chunk)
    decay_out = (log_decay[..., -1:] - log_decay).masked_fill(~to_end, float("-inf")).exp()
    return pairwise, decay_in, decay_out


# ---------------------------------------------------------------- the delta rule

def _in_fp32(rule):
    """Run ``rule`` with autocast off, so it computes in fp32 as it says under a bf16 or
    fp16 run too: autocast made its products half precision (with documents the running
    decay too, and then the triangular system, which the CPU cannot solve in bf16), and
    the state's chain of updates is what fp32 is for."""
    @functools.wraps(rule)
    def wrapped(q: torch.Tensor, *args, **kwargs):
        device = q.device.type  # (meta has no autocast to ask about)
        on = device != "meta" and torch.is_autocast_enabled(device)
        off = torch.autocast(device, enabled=False) if on else contextlib.nullcontext()
        with off:
            return rule(q, *args, **kwargs)
    return wrapped


@_in_fp32
def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           g: torch.Tensor, beta: torch.Tensor, *,
                           chunk_size: int = CHUNK_SIZE, scale: Optional[float] = None,
                           initial_state: Optional[torch.Tensor] = None,
                           segments: Optional[torch.Tensor] = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over a sequence, a chunk at a time. q, k (batch, seq, heads,
    key dim), v (batch, seq, heads, value dim): as many key heads as value heads (the
    layer repeats them); g (log decay, <= 0) and beta (batch, seq, heads); ``scale`` of
    the queries, default 1 / sqrt(key dim); ``initial_state`` (batch, heads, key dim,
    value dim); ``segments`` (batch, seq): the state restarts at each document. Computed
    in fp32. Returns the output (batch, seq, heads, value dim) in v's dtype and the final
    state (fp32): FLA's ``chunk_gated_delta_rule`` arguments and results.

    Within a chunk, with Gamma(i, j) the decay from j to i and S the incoming state, the
    values actually written, u_i = beta_i (v_i - (decayed state before i)^T k_i), solve

        u_i + sum_{j<i} beta_i (k_i . k_j) Gamma(i, j) u_j
            = beta_i v_i - beta_i Gamma(i, start) S^T k_i,

    unit lower-triangular: u = fixed - reads S, both solved before S is known. Then
    o_i = Gamma(i, start) S^T q_i + sum_{j<=i} Gamma(i, j) (q_i . k_j) u_j, and S leaves
    as Gamma(end, start) S + sum_j Gamma(end, j) k_j u_j^T. Documents: every Gamma
    across a boundary is zero."""
    batch, seq, heads, key_dim = k.shape
    value_dim, dtype = v.shape[-1], v.dtype
    scale = key_dim ** -0.5 if scale is None else scale
    pad = -seq % chunk_size

    def chunked(t: torch.Tensor) -> torch.Tensor:  # (b, s, h, *f) -> (b, h, n, c, *f), fp32
        t = t.float().transpose(1, 2)
        t = F.pad(t, (0, 0) * (t.dim() - 3) + (0, pad))  # (padding: k = v = beta = g = 0)
        return t.reshape(batch, heads, -1, chunk_size, *t.shape[3:])

    q, k, v, g, beta = chunked(q) * scale, chunked(k), chunked(v), chunked(g), chunked(beta)
    within, from_start, to_end = _chunk_documents(segments, seq, pad, chunk_size, q.device)
    log_decay = _running_decay(g, within if segments is not None else None)  # (b, h, n, c)
    pairwise, decay_in, decay_out = _decays(log_decay, within, from_start, to_end)
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * pairwise  # (b, h, n, c, c); diagonal: ones
    rhs = torch.cat([v * beta[..., None], k_beta * decay_in[..., None]], -1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    fixed, reads = solved.split([value_dim, key_dim], -1)  # u = fixed - reads @ S
    scores = (q @ k.transpose(-1, -2)) * pairwise  # (b, h, n, c, c); i reads its own write
    q_in = q * decay_in[..., None]
    k_out = k * decay_out[..., None]
    state = (torch.zeros(batch, heads, key_dim, value_dim, device=q.device)
             if initial_state is None else initial_state.float())
    outputs = []
    for n in range(q.shape[2]):  # (the one sequential part: chunk after chunk)
        u = fixed[:, :, n] - reads[:, :, n] @ state  # (b, h, c, value dim)
        outputs.append(q_in[:, :, n] @ state + scores[:, :, n] @ u)
        state = (state * decay_in[:, :, n, -1, None, None]
                 + k_out[:, :, n].transpose(-1, -2) @ u)  # (b, h, key dim, value dim)
    out = torch.stack(outputs, 2).reshape(batch, heads, -1, value_dim)[:, :, :seq]
    return out.transpose(1, 2).to(dtype), state


@_in_fp32
def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               g: torch.Tensor, beta: torch.Tensor, *,
                               scale: Optional[float] = None,
                               initial_state: Optional[torch.Tensor] = None,
                               inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The same rule one token at a time (decoding): arguments and results as
    ``chunk_gated_delta_rule``'s, without documents. ``inplace``: advance
    ``initial_state`` (fp32) itself, without autograd (the decoder's state)."""
    key_dim, value_dim, dtype = k.shape[-1], v.shape[-1], v.dtype
    scale = key_dim ** -0.5 if scale is None else scale
    q, k, v, g, beta = (t.float().transpose(1, 2) for t in (q, k, v, g, beta))  # (b, h, s, ..)
    q = q * scale
    if inplace:
        return _advance_in_place(q, k, v, g, beta, initial_state, dtype)
    state = (torch.zeros(*k.shape[:2], key_dim, value_dim, device=q.device)
             if initial_state is None else initial_state.float())
    outputs = []
    for t in range(q.shape[2]):
        state = state * g[:, :, t, None, None].exp()
        predicted = torch.einsum("bhk,bhkv->bhv", k[:, :, t], state)
        delta = beta[:, :, t, None] * (v[:, :, t] - predicted)  # (b, h, value dim)
        state = state + k[:, :, t, :, None] * delta[:, :, None, :]
        outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], state))
    return torch.stack(outputs, 2).transpose(1, 2).to(dtype), state


@torch.no_grad()
def _advance_in_place(q, k, v, g, beta, state: torch.Tensor, dtype: torch.dtype
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``recurrent_gated_delta_rule`` on ``state`` itself (b, h, s, ...: q scaled): every
    state-sized product in place (a decode step's time goes to them: measured -36% for a
    layer's step at batch 8), both reads of the decayed state in one product, and the
    output from them, q^T S' = q^T S + (q . k) delta, instead of a third read."""
    outputs = []
    for t in range(q.shape[2]):
        state.mul_(g[:, :, t, None, None].exp())
        k_t, q_t = k[:, :, t], q[:, :, t]
        reads = torch.stack([k_t, q_t], 2) @ state  # (b, h, 2, value dim): k^T S, q^T S
        delta = beta[:, :, t, None] * (v[:, :, t] - reads[:, :, 0])
        state.addcmul_(k_t[..., None], delta[..., None, :])
        outputs.append(reads[:, :, 1] + (q_t * k_t).sum(-1, keepdim=True) * delta)
    return torch.stack(outputs, 2).transpose(1, 2).to(dtype), state


# ------------------------------------------------------------ FLA's kernels, if present

def rules(device: torch.device):
    """(chunked rule, recurrent rule) for tensors on ``device``: FLA's kernels on a CUDA
    device where the package is installed, else this module's."""
    if device.type == "cuda":
        fla = _fla_module()
        if fla is not None:
            return FlaRules(fla).chunk, FlaRules(fla).recurrent
    return chunk_gated_delta_rule, recurrent_gated_delta_rule


_FLA: list = []  # [the module or None], once looked for (a list, not functools.cache:
# a compiled decode step reads it as a plain global; the eager prefill looks first)


def _fla_module():
    """FLA's ``fla.ops.gated_delta_rule`` module, or None where it is not installed (or
    fails to import: a Triton it cannot use, say)."""
    if not _FLA:
        try:
            from fla.ops import gated_delta_rule
        except Exception:  # (any import failure: the PyTorch rules serve)
            gated_delta_rule = None
        _FLA.append(gated_delta_rule)
    return _FLA[0]


class FlaRules:
    """FLA's ``chunk_gated_delta_rule`` and ``fused_recurrent_gated_delta_rule`` with this
    module's arguments and results (``module``: anything with those two functions and
    FLA's signatures, 0.6's: q, k, v, then g, beta, scale, initial_state,
    output_final_state, cu_seqlens by keyword; tensors (batch, seq, heads, dim))."""

    def __init__(self, module):
        self.module = module

    def chunk(self, q, k, v, g, beta, *, chunk_size: int = CHUNK_SIZE,
              scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
              segments: Optional[torch.Tensor] = None):
        """``chunk_gated_delta_rule``'s contract (FLA's chunk is its own: 64). With
        ``segments`` the batch goes to FLA as one row of its documents (the final state,
        which no caller reads for a packed batch, is None)."""
        batch, seq = q.shape[:2]
        q, k = q.to(v.dtype), k.to(v.dtype)
        if segments is None:
            return self.module.chunk_gated_delta_rule(
                q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                output_final_state=True)
        flat = lambda t: t.reshape(1, batch * seq, *t.shape[2:])  # noqa: E731
        out, _ = self.module.chunk_gated_delta_rule(
            flat(q), flat(k), flat(v), g=flat(g), beta=flat(beta), scale=scale,
            output_final_state=False, cu_seqlens=document_offsets(segments))
        return out.reshape(batch, seq, *out.shape[2:]), None

    def recurrent(self, q, k, v, g, beta, *, scale: Optional[float] = None,
                  initial_state: Optional[torch.Tensor] = None, inplace: bool = False):
        """(``inplace``: the caller copies the final state back, FLA's own or not)"""
        # (by keyword: FLA's recurrent rule takes other gates, gk and gv, before beta)
        return self.module.fused_recurrent_gated_delta_rule(
            q.to(v.dtype), k.to(v.dtype), v, g=g, beta=beta, scale=scale,
            initial_state=initial_state, output_final_state=True)


def document_offsets(segments: torch.Tensor) -> torch.Tensor:
    """(documents + 1,) long: where each document of the flattened batch starts, then its
    end (FLA's ``cu_seqlens``); a row's start always starts one."""
    batch, seq = segments.shape
    starts = F.pad(segments[:, 1:] != segments[:, :-1], (1, 0), value=True)
    offsets = starts.reshape(-1).nonzero().squeeze(1)
    return torch.cat([offsets, offsets.new_tensor([batch * seq])])
