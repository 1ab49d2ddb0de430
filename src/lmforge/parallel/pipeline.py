"""Pipeline parallelism: split a Llama into stages and run a schedule over them.

A stage is a copy of the (meta-device) model with the other stages' layers deleted and,
except at the ends, no embedding, final norm or head; parameter names are unchanged, so
checkpoints do not depend on the layout. With ``pp_virtual_stages = v`` each rank holds v
stages, in loop order (rank r holds stages r, r + pp, ...), for the interleaved schedule.

The schedule receives the whole local batch of a step and splits it into
``microbatches`` pieces; the loss of each piece is its token-loss sum divided by the
step's global valid-token count, so gradients are not rescaled by the schedule.
"""
from __future__ import annotations

import copy
import inspect
from typing import Callable

import torch
from torch import nn

from lmforge.config import ConfigError

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


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
        if stage != 0:
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
