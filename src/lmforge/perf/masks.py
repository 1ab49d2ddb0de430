"""The dense attention masks a run builds, as the estimate counts them (docs/estimate.md,
"Attention masks and context parallelism"). ``models.attention.attend`` gives SDPA a
boolean mask wherever the plain causal rule does not describe who sees whom: under
context parallelism (local queries, every key, by global position), for packed documents
with ``model.attention=sdpa``, and in a sliding-window layer whose sequence is longer
than its window. Each mask is built once per micro-batch and window and shared by the
layers; what a layer's attention then keeps depends on the device's kernel:

* the CPU's kernel converts the mask to the query's dtype on every call and keeps that
  copy for backward (measured: one (rows, 1, queries, keys) tensor per layer);
* on CUDA the memory-efficient kernel reads the boolean mask itself, but takes no grouped
  heads, so k and v are repeated to every head (``attention._sdpa``) and kept so.

FlexAttention's block masks are a few bytes per 128 x 128 block: not counted."""
from __future__ import annotations

from dataclasses import dataclass

from lmforge.models.registry import family_of
from lmforge.perf.estimate_setup import Setup


@dataclass(frozen=True)
class DenseMasks:
    """Per token of a micro-batch on one device."""
    share: float  # of the layers, those whose attention reads a dense mask
    windows: int  # masks built per micro-batch: one per distinct window (None included)
    keys: int  # columns of each mask: the whole sequence's positions
    per_row: float  # mask rows per token's row: 1 with documents, else 1 / micro-batch

    @property
    def shared_bytes(self) -> float:
        """The boolean masks every layer reads, per token (held from the first block's
        forward to the last block's backward)."""
        return self.windows * self.keys * self.per_row

    def copy_bytes(self, dtype_bytes: int) -> float:
        """One layer's converted copy, per token (CPU), averaged over the layers."""
        return self.share * dtype_bytes * self.keys * self.per_row


NONE = DenseMasks(share=0.0, windows=0, keys=0, per_row=0.0)


def dense_masks(setup: Setup) -> DenseMasks:
    """Which layers of ``setup`` attend through a dense mask, and how many masks a
    micro-batch builds (the estimate's ``--attention eager`` keeps whole score matrices
    instead: nothing more is counted there)."""
    if setup.attention == "eager":
        return NONE
    args, seq = setup.args, setup.batch.seq_len
    block = family_of(args).block(args)
    windows = [block.sliding_window if kind == "sliding" else None
               for kind in block.attention or ("global",) * args.n_layers]
    documents = setup.cfg.data.document_mask and setup.cfg.model.attention == "sdpa"
    if setup.layout.cp > 1 or documents:
        masked = windows
    elif setup.cfg.model.attention == "sdpa":
        masked = [w for w in windows if w is not None and seq > w]
    else:
        masked = []
    if not masked:
        return NONE
    return DenseMasks(share=len(masked) / len(windows), windows=len(set(masked)), keys=seq,
                      per_row=1.0 if documents else 1.0 / setup.micro_batch)
