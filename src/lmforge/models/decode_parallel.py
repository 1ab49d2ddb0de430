"""The batched decoder (``models/generate.py``) with a model sharded for training:

* **Data parallelism** (``generate(group=...)``): each rank decodes its own prompts, but
  every forward of a sharded model (FSDP2's gathers, tensor parallelism's reductions) is
  collective, so every rank of the data-parallel group runs as many steps as the longest
  (``group_max``) and stops only when all are done (``all_done``, looked at every
  sync_every tokens).
* **Sequence parallelism** (``sequence_shards``, set by ``parallel.tensor``) splits every
  forward's tokens over the tp ranks evenly: the prefill is padded to a multiple of them
  and a one-token step runs its token and shards - 1 fillers (``sharded_step``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from lmforge.models.attention import DecodeMask


def group_max(value: int, group, model) -> int:
    """``value``'s maximum over ``group``'s ranks (itself without a group)."""
    if group is None:
        return value
    t = torch.tensor([value], dtype=torch.long, device=next(model.parameters()).device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t)


def all_done(done: torch.Tensor, group) -> bool:
    """Whether every row is done, on every rank of ``group``."""
    if group is None:
        return bool(done.all())
    left = (~done).sum().reshape(1).to(torch.long)
    dist.all_reduce(left, group=group)
    return int(left) == 0


def sequence_shards(model, compile: bool) -> int:
    """The ranks sequence parallelism splits a forward's tokens over (1: none)."""
    shards = getattr(model, "sequence_shards", 1)
    if compile and shards > 1:
        raise ValueError("generate: compile=True under sequence parallelism is not "
                         "supported; decode eagerly")
    return shards


def sharded_step(model, token, positions, start, column: int, caches, shards: int,
                 pad_id: int):
    """One token's step under sequence parallelism: the token at ``column`` and
    ``shards - 1`` fillers after it, written to the cache at their columns (a filler's
    keys are overwritten by the next step's token before any query may see them: a
    query sees columns up to its own; a recurrent state leaves them out, ``real``); the
    logits of every column (the token's: 0)."""
    offsets = torch.arange(shards, device=token.device)
    tokens = torch.cat([token[:, None], token.new_full((len(token), shards - 1), pad_id)], 1)
    columns = column + offsets
    for c in caches:
        c.columns = columns
    return model(tokens, positions + offsets[None, :], DecodeMask(start, columns, real=1),
                 caches)
