"""Pipeline parallelism: split a Llama into stages and run a schedule over them.

A stage is a copy of the (meta-device) model with the other stages' layers deleted and,
except at the ends, no embedding, final norm or head; parameter names are unchanged, so
checkpoints do not depend on the layout. With ``pp_virtual_stages = v`` each rank holds v
stages, in loop order (rank r holds stages r, r + pp, ...), for the interleaved schedule.

The schedule receives the whole local batch of a step and splits it into
``config.pipeline_microbatches`` pieces; the loss of each piece is its token-loss sum
divided by the step's global valid-token count, so gradients are not rescaled by the
schedule.

A tied model (``tie_embeddings``: the head's weight is the embedding's) keeps, as
Megatron does, a copy of that weight on the first stage (as the embedding) and on the
last (as the head, under the embedding's name, so checkpoints match the whole model's):
``TiedEmbedding`` makes the copies equal at the start and sums their gradients before
clipping and the optimizer step, so the optimizers keep them equal.
"""
from __future__ import annotations

import copy
import inspect
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from lmforge.config import ConfigError


def stage_layers(n_layers: int, n_stages: int) -> list[list[int]]:
    if n_layers % n_stages:
        raise ConfigError(f"parallel.pp: {n_layers} layers do not split evenly into "
                          f"{n_stages} pipeline stages (pp x pp_virtual_stages)")
    per = n_layers // n_stages
    return [list(range(s * per, (s + 1) * per)) for s in range(n_stages)]


def stage_ids_for_rank(pp_rank: int, pp: int, virtual: int) -> list[int]:
    return [pp_rank + k * pp for k in range(virtual)]


def split_model(model: nn.Module, pp_rank: int, pp: int, virtual: int
                ) -> list[tuple[int, nn.Module]]:
    """This rank's stages as (stage index, module) pairs."""
    n_stages = pp * virtual
    layers = stage_layers(len(model.layers), n_stages)
    parts = []
    for stage in stage_ids_for_rank(pp_rank, pp, virtual):
        part = copy.deepcopy(model)
        keep = {str(i) for i in layers[stage]}
        for name in list(part.layers.keys()):
            if name not in keep:
                del part.layers[name]
        tied_head = model.args.tie_embeddings and stage == n_stages - 1
        if stage != 0 and not tied_head:
            part.tok_embeddings = None
        if stage != n_stages - 1:
            part.norm = None
            part.output = None
        parts.append((stage, part))
    return parts


def build_schedule(parts: list[tuple[int, nn.Module]], n_stages: int, schedule: str,
                   n_microbatches: int, loss_fn: Callable, device: torch.device, pp_group):
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    stages = [PipelineStage(module, index, n_stages, device, group=pp_group)
              for index, module in parts]
    if schedule == "interleaved_1f1b":
        return ScheduleInterleaved1F1B(stages, n_microbatches, loss_fn=loss_fn,
                                       scale_grads=False)
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    return cls(stages[0], n_microbatches, loss_fn=loss_fn, scale_grads=False)


def step_options(schedule) -> dict:
    """``return_outputs=False`` where the schedule takes it: otherwise the last stage keeps
    every micro-batch's logits until the step ends, to return them merged, and the trainer
    never reads them (for a 128K vocabulary, 0.5 GiB per 1K tokens in bf16). Older
    torch versions lack the option and keep them."""
    if "return_outputs" in inspect.signature(schedule.step).parameters:
        return {"return_outputs": False}
    return {}


def has_first_stage(parts) -> bool:
    return any(index == 0 for index, _ in parts)


def has_last_stage(parts, n_stages: int) -> bool:
    return any(index == n_stages - 1 for index, _ in parts)


class TiedEmbedding:
    """This rank's copy of a tied model's embedding weight (None on a middle stage) and
    the group pairing each first-stage rank with the last-stage rank of the same data-
    and tensor-parallel coordinates, whose shards of the weight correspond."""

    def __init__(self, weight: nn.Parameter | None, on_last_stage: bool, group):
        self.weight = weight
        self.on_last_stage = on_last_stage  # the copy whose norm the first stage counts
        self.group = group

    @classmethod
    def for_stages(cls, parts: list[tuple[int, nn.Module]], n_stages: int, mesh
                   ) -> "TiedEmbedding":
        """Collective (every rank creates the groups). ``mesh``: the run's DeviceMesh,
        pipeline dimension first."""
        ranks = mesh.mesh  # (pp, dp_replicate, dp_shard, tp): global ranks
        pairs = [[int(first), int(last)]
                 for first, last in zip(ranks[0].flatten(), ranks[-1].flatten())]
        group, _ = dist.new_subgroups_by_enumeration(pairs)
        ends = [(index, part) for index, part in parts if index in (0, n_stages - 1)]
        if not ends:
            return cls(None, False, None)
        index, part = ends[0]
        return cls(part.tok_embeddings.weight, index == n_stages - 1, group)

    def is_duplicate(self, param: nn.Parameter) -> bool:
        """Whether ``param`` is the last stage's copy (counted once, on the first)."""
        return self.on_last_stage and param is self.weight

    @torch.no_grad()
    def sync_weights(self) -> None:
        """The first stage's values on the last (per-shard initialisation draws each
        stage's own)."""
        if self.weight is not None:
            dist.broadcast(_local(self.weight), group=self.group, group_src=0)

    @torch.no_grad()
    def sum_gradients(self) -> None:
        """Each copy's gradient becomes the sum of both: the whole model's gradient."""
        if self.weight is None or self.weight.grad is None:
            return
        grad = self.weight.grad
        if hasattr(grad, "placements") and grad.placements != self.weight.placements:
            # A tensor-parallel embedding's backward leaves a replicated gradient of its
            # vocab-sharded weight; shard it like the weight so the two copies' shards pair.
            grad = self.weight.grad = grad.redistribute(placements=self.weight.placements)
        dist.all_reduce(_local(grad), group=self.group)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2 / tensor parallel), else ``t`` itself."""
    return t.to_local() if hasattr(t, "to_local") else t
