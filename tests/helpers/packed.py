"""Packed batches as the data pipeline builds them, and one tiny model per family and
attention flag set (sliding windows shorter than the rows): what the attention tests on
the CPU and on a GPU compare flex and sdpa on."""
from __future__ import annotations

import numpy as np

from helpers.tiny_models import tiny_family_args
from lmforge.data.dataset import collate, make_row
from lmforge.data.sft_rows import sft_row
from lmforge.models.gemma3 import Gemma3Args
from lmforge.models.phi3 import Phi3Args

SEQ = 24


def attention_families() -> dict:
    """``tiny_family_args`` plus Phi-3 with a window and Gemma 3 (sliding layers every
    other one, a query scale of its own)."""
    args = tiny_family_args()
    args["phi3-window"] = Phi3Args(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97,
                                   ffn_dim=64, max_seq_len=64, sliding_window=5)
    args["gemma3"] = Gemma3Args(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97,
                                ffn_dim=64, explicit_head_dim=12, max_seq_len=64,
                                sliding_window=5, sliding_pattern=2, query_pre_attn_scalar=10)
    return args


def pretrain_batch(vocab: int) -> dict:
    """Two rows of documents packed back to back (the second ends in padding)."""
    g = np.random.default_rng(0)
    rows = [make_row([g.integers(0, vocab, n) for n in (7, 11, 7)], SEQ, document_mask=True),
            make_row([g.integers(0, vocab, n) for n in (3, 14)], SEQ, document_mask=True)]
    return collate(rows, [0, 1])


def sft_batch(vocab: int) -> dict:
    """Two packed SFT rows: samples with their trained tokens, then padding."""
    g = np.random.default_rng(1)

    def sample(n):
        return g.integers(0, vocab, n), np.arange(n) >= n // 2  # the answer: the second half
    rows = [sft_row([sample(9), sample(8), sample(6)], SEQ, 0, packed=True),
            sft_row([sample(12), sample(5)], SEQ, 0, packed=True)]
    return collate(rows, [0, 1])
