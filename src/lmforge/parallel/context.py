"""Context parallelism (``parallel.cp``): every rank of a cp group loads the same rows and
keeps its part of each sequence. The sequence is cut into 2 x cp chunks and rank r keeps
chunks r and 2cp - 1 - r (one from the front, one from the back), so every rank has the
same share of the causal mask's work, as torchtitan and Megatron balance it. Positions
stay global (RoPE, documents); the attention gathers the keys and values of the whole
sequence per layer (``models.attention.ContextParallel``: with grouped-query attention
they are a fraction of the queries' size, as Llama 3's training did). The loss of a step
adds up over the cp ranks' tokens, and FSDP2 shards over dp_shard x cp, so the gradients'
reduce-scatter sums the cp ranks' parts (``train.step.normalize_loss``)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lmforge import IGNORE_INDEX
from lmforge.models.attention import ContextParallel
from lmforge.parallel.mesh import ParallelDims


def cp_index(seq: int, cp: int, rank: int) -> torch.Tensor:
    """The global positions rank ``rank`` of ``cp`` keeps of a ``seq``-long sequence."""
    if seq % (2 * cp):
        raise ValueError(f"a sequence of {seq} positions does not split into 2 x "
                         f"parallel.cp = {2 * cp} chunks")
    chunk = seq // (2 * cp)
    front, back = rank * chunk, (2 * cp - 1 - rank) * chunk
    return torch.cat([torch.arange(front, front + chunk), torch.arange(back, back + chunk)])


def cp_view(batch: dict, dims: ParallelDims) -> dict:
    """This cp rank's part of ``batch`` (the whole rows every rank of the group loaded):
    its tokens, labels and global positions, and the attention's ``ContextParallel``.
    Rows whose length 2 x cp does not divide (an SFT batch's width, a held-out tail) are
    padded at the end first: no target, and no real token sees them (they come after)."""
    batch = _padded(batch, 2 * dims.cp)
    rows, seq = batch["input_ids"].shape
    index = cp_index(seq, dims.cp, dims.cp_rank)
    view = {k: v for k, v in batch.items() if k not in ("segments", "mask")}
    view.update(input_ids=batch["input_ids"][:, index], labels=batch["labels"][:, index],
                positions=batch["positions"][:, index],
                context=ContextParallel(index, seq, dims.group("cp"), batch.get("segments")))
    return view


def _padded(batch: dict, multiple: int) -> dict:
    """``batch`` with positions (global: 0..seq-1 unless it has its own), and its rows
    padded to a multiple of ``multiple``."""
    rows, seq = batch["input_ids"].shape
    positions = batch.get("positions")
    if positions is None:
        positions = torch.arange(seq).expand(rows, seq)
    batch = {**batch, "positions": positions}
    pad = -seq % multiple
    if not pad:
        return batch
    more = torch.arange(1, pad + 1).expand(rows, pad)
    batch.update(input_ids=F.pad(batch["input_ids"], (0, pad)),
                 labels=F.pad(batch["labels"], (0, pad), value=IGNORE_INDEX),
                 positions=torch.cat([positions, positions[:, -1:] + more], dim=1))
    if batch.get("segments") is not None:  # the padding: a document of its own
        segments = batch["segments"]
        batch["segments"] = F.pad(segments, (0, pad), value=int(segments.max()) + 1)
    return batch
