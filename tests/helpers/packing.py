"""What the CPU decode packs (``models/packed_linear.py``): each ``packed_linears`` call the
decoder makes, recorded."""
from __future__ import annotations

import contextlib

import lmforge.models.generate as decoder
from lmforge.models.packed_linear import packed_linears


def record_packings(monkeypatch) -> list[int]:
    """The list that each ``packed_linears`` call of the decoder appends its count of packed
    layers to (0: it packed nothing, e.g. finding them packed already)."""
    packed: list[int] = []

    @contextlib.contextmanager
    def recording(model, rows, budget):
        with packed_linears(model, rows, budget) as n:
            packed.append(n)
            yield n
    monkeypatch.setattr(decoder, "packed_linears", recording)
    return packed
