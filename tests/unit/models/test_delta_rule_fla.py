"""FLA's kernels behind the delta rule's arguments (models/delta_rule.py ``FlaRules``),
checked on the CPU with a stand-in for FLA's module that keeps FLA's signatures and
variable-length contract (``cu_seqlens``: a batch of one row, each sequence from a fresh
state) and computes with the recurrent rule one sequence at a time: a packed batch's
documents reach it as FLA's sequences, and its results come back in our shapes. The
kernels themselves are compared on a GPU (tests/gpu/test_fla_cuda.py)."""
from __future__ import annotations

import torch

from lmforge.models.delta_rule import (FlaRules, chunk_gated_delta_rule, document_offsets,
                                       recurrent_gated_delta_rule, rules)
from lmforge.models.gated_deltanet import l2_normalize


class StandInFla:
    """FLA's two functions by their signatures (0.6's), computed by our recurrent rule."""

    @staticmethod
    def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                               output_final_state=False, use_qk_l2norm_in_kernel=False,
                               use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                               state_v_first=False, cu_seqlens=None, **kwargs):
        if cu_seqlens is None:
            out, state = recurrent_gated_delta_rule(q, k, v, g, beta, scale=scale,
                                                    initial_state=initial_state)
            return out, state if output_final_state else None
        assert q.shape[0] == 1 and initial_state is None  # (FLA's varlen contract)
        bounds = cu_seqlens.tolist()
        outs = [recurrent_gated_delta_rule(*(t[:, a:b] for t in (q, k, v, g, beta)),
                                           scale=scale)[0]
                for a, b in zip(bounds, bounds[1:])]
        return torch.cat(outs, 1), None

    @staticmethod
    def fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None,
                                         scale=None, initial_state=None,
                                         output_final_state=False, **kwargs):
        assert gk is None and gv is None
        return StandInFla.chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state,
                                                 output_final_state)


def inputs(batch: int, seq: int, heads: int = 2, dk: int = 8, dv: int = 5):
    gen = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    return (l2_normalize(rand(batch, seq, heads, dk)), l2_normalize(rand(batch, seq, heads, dk)),
            rand(batch, seq, heads, dv), -torch.nn.functional.softplus(rand(batch, seq, heads)),
            rand(batch, seq, heads).sigmoid(), rand(batch, heads, dk, dv))


def test_document_offsets_start_each_document_and_each_row():
    segments = torch.tensor([[0, 0, 1, 1, 1], [4, 4, 4, 7, 7]])  # row 1 starts a document
    assert document_offsets(segments).tolist() == [0, 2, 5, 8, 10]


def test_packed_documents_reach_fla_as_its_sequences():
    q, k, v, g, beta, _ = inputs(2, 13)
    segments = torch.repeat_interleave(torch.arange(3), torch.tensor([4, 6, 3])).expand(2, 13)
    want, _ = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=4, segments=segments)
    got, state = FlaRules(StandInFla).chunk(q, k, v, g, beta, segments=segments)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert state is None  # (a packed batch's final state has no reader)


def test_a_state_goes_in_and_comes_out_as_ours():
    q, k, v, g, beta, state = inputs(2, 9)
    want = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=4, initial_state=state)
    got = FlaRules(StandInFla).chunk(q, k, v, g, beta, initial_state=state)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    step = FlaRules(StandInFla).recurrent(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1],
                                          initial_state=state)
    for a, b in zip(step, recurrent_gated_delta_rule(q[:, :1], k[:, :1], v[:, :1], g[:, :1],
                                                     beta[:, :1], initial_state=state)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_the_cpu_always_takes_the_pytorch_rules():
    assert rules(torch.device("cpu")) == (chunk_gated_delta_rule, recurrent_gated_delta_rule)
