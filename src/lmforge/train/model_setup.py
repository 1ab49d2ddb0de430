"""From model args to a trainable, possibly parallel model on its device.

The model is built on the meta device, split into pipeline stages if pp > 1, then
parallelized (TP -> activation checkpointing -> compile -> FSDP2), materialised with
``to_empty`` and given weights: those of ``model.init_from``, or a seeded initialisation
of the whole model, sliced into each rank's shards, so that the starting weights do not
depend on the parallel layout (models above ``LAYOUT_INDEPENDENT_INIT_BYTES`` are
initialised shard by shard instead, which needs no full copy but is layout dependent).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from lmforge.config import JobConfig
from lmforge.eval.evaluate import loss_sums, mean_loss
from lmforge.job import Job
from lmforge.models.common import count_parameters, materialize
from lmforge.models.hf import from_hf_state_dict, read_hf_state_dict
from lmforge.models.loss import IGNORE_INDEX
from lmforge.models.registry import build_model
from lmforge.parallel import full_value
from lmforge.parallel.context import cp_view
from lmforge.parallel.mesh import ParallelDims
from lmforge.parallel.offload import ActivationOffloader, offload_blocks
from lmforge.parallel.parallelize import apply_data_parallel, apply_model_parallel
from lmforge.parallel.pipeline import (TiedEmbedding, build_schedule, has_first_stage,
                                       has_last_stage, split_model, step_options)
from lmforge.peft.adapters import load_adapter
from lmforge.peft.lora import after_materialize, is_lora_param, prepare_model_for_lora
from lmforge.train.objectives import NEXT_TOKEN, NextToken, objective_for
from lmforge.train.precision import frozen_linears_to_bf16
from lmforge.train.step import ExpertBalance, accumulate_gradients, normalize_loss

LAYOUT_INDEPENDENT_INIT_BYTES = 4 * 2**30


@dataclass
class TrainModel:
    """This rank's part of the model and how to run a step on it."""
    parts: list[nn.Module]  # one module, or this rank's pipeline stages
    args: Any  # the family's args (LlamaArgs, GPTJArgs)
    dims: ParallelDims
    schedule: object = None  # pipeline schedule when pp > 1
    stage_ids: list[int] = field(default_factory=list)
    loss_chunk_tokens: int = 0  # train.loss_chunk_tokens (one process, dp, FSDP only)
    offload: Optional[ActivationOffloader] = None  # train.activation_offload
    tied: Optional[TiedEmbedding] = None  # a tied model's embedding on two pipeline stages
    step_rows: int = 0  # rows of a step's local batch (the pipeline schedule's input shape)
    objective: NextToken = NEXT_TOKEN  # what a step minimises (train.objectives)
    _n_valid: int = 1  # the current step's, for pipeline_loss
    _loss_scale: float = 1.0
    _summing: bool = False  # evaluating: pipeline_loss returns plain token-loss sums

    @property
    def mesh(self):
        return self.dims.mesh

    @property
    def whole(self) -> Optional[nn.Module]:
        return self.parts[0] if self.dims.pp == 1 else None

    def parameters(self):
        seen = {}
        for part in self.parts:
            for p in part.parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())

    def train(self, mode: bool = True) -> None:
        for part in self.parts:
            part.train(mode)

    def local(self, batches):
        """This rank's part of each batch: under context parallelism, its chunks of every
        sequence (``parallel.context``); else the batches themselves."""
        if self.dims.cp == 1:
            return batches
        return (cp_view(batch, self.dims) for batch in batches)

    def loss_context(self):
        if self.dims.tp > 1:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def forward_backward(self, micro_batches: list[dict], n_valid: int,
                         device: torch.device, autocast, loss_scale: float = 1.0,
                         stats: Optional[dict] = None,
                         balance: Optional[ExpertBalance] = None) -> torch.Tensor:
        """This rank's share of the step loss (sum of its units' losses / n_valid);
        backward runs on it times ``loss_scale`` (fp16's, else 1); ``stats`` gains the
        objective's metric sums; ``balance``: an MoE model's load balancing."""
        with self.loss_context():
            if self.schedule is None:
                # (FSDP averages over dp x cp ranks: normalize_loss's factor covers both)
                return accumulate_gradients(self.parts[0], self.local(micro_batches),
                                            device, autocast, n_valid,
                                            self.dims.dp * self.dims.cp,
                                            self.loss_chunk_tokens, loss_scale,
                                            self.objective, stats, balance)
            return self._pipeline_step(micro_batches, n_valid, device, autocast, loss_scale)

    def _pipeline_step(self, micro_batches, n_valid, device, autocast, loss_scale
                       ) -> torch.Tensor:
        self._n_valid, self._loss_scale = n_valid, loss_scale
        parts = list(zip(self.stage_ids, self.parts))
        n_stages = self.dims.pp * len(self.parts)
        inputs = torch.cat([b["input_ids"] for b in micro_batches]).to(device)
        targets = torch.cat([b["labels"] for b in micro_batches]).to(device)
        losses: list = []
        kwargs = step_options(self.schedule)
        if has_last_stage(parts, n_stages):
            kwargs.update(target=targets, losses=losses)
        with autocast():
            if has_first_stage(parts):
                self.schedule.step(inputs, **kwargs)
            else:
                self.schedule.step(**kwargs)
        total = torch.zeros((), device=device)
        for loss in losses:  # (none off the last stage)
            total += full_value(loss)
        if self.tied is not None:
            self.tied.sum_gradients()
        # The share normalize_loss(.., dp=1) gives; the scale, a power of two, divides
        # out exactly.
        return total / (self.dims.dp * loss_scale)

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The schedule's loss function, called per pipeline microbatch on the last stage
        (and by the schedule's set-up): what it returns is back-propagated, so it carries
        the loss scale."""
        loss_sum = self.objective.stage_loss_sum(output, target)
        if self._summing:
            return loss_sum
        loss = normalize_loss(loss_sum, self._n_valid, self.dims.dp)
        return loss * self._loss_scale

    def evaluate(self, batches, device, autocast) -> tuple[float, int]:
        """Mean per-token loss over the held-out data of every data-parallel rank, and
        their valid tokens: each rank scores ``batches`` (its own share), and the sums
        meet before the division. Collective under FSDP, tensor and pipeline
        parallelism: every rank calls it, with the same number of batches."""
        with self.loss_context():
            if self.schedule is None:
                total, tokens = loss_sums(self.parts[0], self.local(batches), device,
                                          autocast, self.loss_chunk_tokens)
            else:
                total, tokens = self._pipeline_loss_sums(batches, device, autocast)
        if self.dims.dp * self.dims.cp > 1:  # (tp and pp ranks of a dp group hold copies)
            sums = torch.stack([total, total.new_tensor(float(tokens))])
            dist.all_reduce(sums, group=self.dims.group(self.dims.dp_cp_group))
            total, tokens = sums[0], int(sums[1])
        return mean_loss(total, tokens)

    def _pipeline_loss_sums(self, batches, device, autocast) -> tuple[torch.Tensor, int]:
        """Forward-only schedule passes over inputs of the training step's shape (the
        stages were shaped by it); the last stage's loss sums reach every pp rank."""
        parts = list(zip(self.stage_ids, self.parts))
        first = has_first_stage(parts)
        last = has_last_stage(parts, self.dims.pp * len(self.parts))
        total = torch.zeros((), dtype=torch.float64, device=device)
        tokens = 0
        self.train(False)
        self._summing = True
        try:
            for inputs, targets in step_shaped(batches, self.step_rows):
                tokens += int((targets != IGNORE_INDEX).sum())
                losses: list = []
                kwargs = {"target": targets.to(device), "losses": losses} if last else {}
                with torch.no_grad(), autocast():
                    if first:
                        self.schedule.eval(inputs.to(device), **kwargs)
                    else:
                        self.schedule.eval(**kwargs)
                for loss in losses:
                    total += full_value(loss).double()
        finally:
            self._summing = False
            self.train(True)
        dist.all_reduce(total, group=self.dims.group("pp"))
        return total, tokens


def step_shaped(batches, rows: int):
    """(input_ids, labels) of exactly ``rows`` rows from consecutive batches; the last
    is padded with rows that have no targets."""
    ids: list = []
    labels: list = []
    held = 0
    for batch in batches:
        ids.append(batch["input_ids"])
        labels.append(batch["labels"])
        held += len(batch["input_ids"])
        while held >= rows:
            all_ids, all_labels = torch.cat(ids), torch.cat(labels)
            yield all_ids[:rows], all_labels[:rows]
            ids, labels, held = [all_ids[rows:]], [all_labels[rows:]], held - rows
    if held:
        all_ids, all_labels = torch.cat(ids), torch.cat(labels)
        pad = rows - held
        yield (torch.cat([all_ids, all_ids.new_zeros(pad, all_ids.shape[1])]),
               torch.cat([all_labels, all_labels.new_full((pad, all_labels.shape[1]),
                                                          IGNORE_INDEX)]))


def build_train_model(job: Job, device: torch.device, dims: ParallelDims = ParallelDims(),
                      param_dtype: Optional[torch.dtype] = None) -> TrainModel:
    """This rank's model of ``job`` for the layout ``dims`` (default: one plain process);
    ``param_dtype``: FSDP's compute dtype for parameters."""
    cfg, args = job.config, job.args
    model = build_model(args)  # meta: nothing allocated yet
    if dims.pp > 1:
        stages = split_model(model, dims.pp_rank, dims.pp, cfg.parallel.pp_virtual_stages)
    else:
        stages = [(0, model)]
    tm = TrainModel([part for _, part in stages], args, dims,
                    stage_ids=[i for i, _ in stages],
                    loss_chunk_tokens=cfg.train.loss_chunk_tokens,
                    objective=objective_for(job))
    for part in tm.parts:
        part.attention = cfg.model.attention  # (models/attention.py)
        part.fused_loss = cfg.train.fused_loss  # (models/loss.py: fused_head)
        if cfg.lora.enabled:  # module swap on the meta model, before any sharding
            prepare_model_for_lora(part, cfg.lora)
        apply_model_parallel(part, dims, cfg)
    if cfg.train.activation_offload:
        # Around the (checkpointed) blocks; one offloader for all of this rank's stages.
        tm.offload = ActivationOffloader(device)
        for part in tm.parts:
            offload_blocks(part, tm.offload)
    full_sd = initial_state_dict(cfg, args, dims)
    small = 4 * count_parameters(model) <= LAYOUT_INDEPENDENT_INIT_BYTES
    if full_sd is not None and small:
        # Load while only tensor-parallel sharded (a full copy / tp per rank), then shard
        # over data parallelism: this also handles sizes that do not divide evenly.
        _materialize_all(tm, device)
        load_full_state_dict(tm, full_sd)
        _finish_lora(tm, job)
        _apply_data_parallel_all(tm, cfg, param_dtype)
    else:
        _apply_data_parallel_all(tm, cfg, param_dtype)
        _materialize_all(tm, device)
        if full_sd is not None:
            load_full_state_dict(tm, full_sd)
        else:
            # Too large for a full copy per rank: each rank initialises its own shards.
            torch.manual_seed(cfg.train.seed + dims.pp_rank)
            for part in tm.parts:
                part.init_weights()
        _finish_lora(tm, job)
    if cfg.train.param_dtype == "bf16":  # low-memory training: weights stored in bf16
        for part in tm.parts:
            part.to(torch.bfloat16)
    if dims.pp > 1:
        _build_pipeline(tm, job, device)
    tm.train()
    return tm


def _build_pipeline(tm: TrainModel, job: Job, device: torch.device) -> None:
    """The schedule over this rank's stages, and a tied embedding's two copies made equal."""
    parts, n_stages = list(zip(tm.stage_ids, tm.parts)), tm.dims.pp * len(tm.parts)
    tm.step_rows = job.batch.accumulation * job.batch.micro_batch_size
    if tm.args.tie_embeddings:
        tm.tied = TiedEmbedding.for_stages(parts, n_stages, tm.mesh)
        tm.tied.sync_weights()
    tm.schedule = build_schedule(parts, n_stages, job.config.parallel.pp_schedule,
                                 job.batch.pipeline_microbatches, tm.pipeline_loss,
                                 device, tm.dims.group("pp"))


def _finish_lora(tm: TrainModel, job: Job) -> None:
    """Adapter init (B = 0, so training starts from the base model exactly), optional
    NF4/int8 quantization of the frozen base, optional adapter load."""
    cfg = job.config
    if not cfg.lora.enabled:
        return
    torch.manual_seed(cfg.train.seed + 1)
    for part in tm.parts:
        after_materialize(part, cfg.lora)
        if cfg.lora.adapter_from:
            load_adapter(part, cfg.lora.adapter_from)
        if job.compute == "bf16" and not cfg.lora.quantize:
            frozen_linears_to_bf16(part)


def _materialize_all(tm: TrainModel, device: torch.device) -> None:
    for part in tm.parts:
        materialize(part, device, init=False)


def _apply_data_parallel_all(tm: TrainModel, cfg: JobConfig, param_dtype) -> None:
    for part in tm.parts:
        apply_data_parallel(part, tm.dims, cfg, param_dtype)


def initial_state_dict(cfg: JobConfig, args, dims: ParallelDims
                       ) -> Optional[dict]:
    """Full starting weights when they are affordable on every rank: a local HF model,
    or (with several processes) a seeded initialisation of the whole model, the same
    draws as a single process makes. None: initialise in place / per shard."""
    if cfg.model.init_from:
        sd = from_hf_state_dict(read_hf_state_dict(cfg.model.init_from), args,
                                source=f"{cfg.model.init_from} weights")
        return {k: v.float() for k, v in sd.items()}
    if dims.mesh is None or 4 * count_parameters(build_model(args)) > LAYOUT_INDEPENDENT_INIT_BYTES:
        return None
    torch.manual_seed(cfg.train.seed)
    return materialize(build_model(args), "cpu").state_dict()


def load_full_state_dict(tm: TrainModel, sd: dict) -> None:
    """Full (unsharded) tensors -> each part's shards."""
    for part in tm.parts:
        # Adapter weights are not in a base checkpoint; they are initialised afterwards.
        wanted = {k: sd[k] for k in part.state_dict() if not is_lora_param(k)}
        strict = len(wanted) == len(part.state_dict())
        if tm.mesh is None:
            missing, unexpected = part.load_state_dict(wanted, strict=strict)
            assert not unexpected and all(is_lora_param(k) for k in missing)
            continue
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(part, wanted,
                             options=StateDictOptions(full_state_dict=True, strict=strict))


def gather_full_state_dict(tm: TrainModel) -> Optional[dict]:
    """The whole model's tensors on CPU, on global rank 0 (None elsewhere). Collective."""
    if tm.mesh is None:
        return {k: v.detach().cpu() for k, v in tm.parts[0].state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = {}
    for part in tm.parts:
        full = get_model_state_dict(part, options=StateDictOptions(full_state_dict=True))
        sd.update({k: full_value(v).cpu() for k, v in full.items()})
    if tm.dims.pp == 1:
        return sd if dist.get_rank() == 0 else None
    # One representative per stage (dp and tp coordinates 0) sends its stage to rank 0.
    if tm.dims.dp_rank != 0 or tm.dims.tp_rank != 0:
        return None
    pp_group = tm.dims.group("pp")
    gathered = [None] * tm.dims.pp if dist.get_rank() == 0 else None
    dist.gather_object(sd, gathered, dst=0, group=pp_group)
    if dist.get_rank() != 0:
        return None
    merged = {}
    for stage_sd in gathered:
        merged.update(stage_sd)
    return merged


def clip_grad_norm(tm: TrainModel, max_norm: float) -> torch.Tensor:
    """Total gradient norm over every rank's parameters, then clipping (max_norm > 0).

    Sharded (DTensor) gradients are reduced over their mesh; pipeline stages hold
    disjoint parameters (but for a tied embedding's copy on the last stage, counted on
    the first), so their squared norms are summed across the pp group."""
    params = [p for p in tm.parameters() if p.grad is not None]
    grads = [p.grad for p in params]
    by_mesh: dict = {}
    for g in (p.grad for p in params if tm.tied is None or not tm.tied.is_duplicate(p)):
        key = id(g.device_mesh) if hasattr(g, "device_mesh") else None
        by_mesh.setdefault(key, []).append(g)
    squared = None
    for group_grads in by_mesh.values():
        norm = full_value(torch.nn.utils.get_total_norm(group_grads, 2.0)).float()
        squared = norm ** 2 if squared is None else squared + norm ** 2
    if squared is None:
        squared = torch.zeros((), device=next(iter(tm.parameters())).device)
    if tm.dims.pp > 1:
        dist.all_reduce(squared, group=tm.dims.group("pp"))
    total = squared.sqrt()
    if max_norm > 0:
        # A Python float scales plain and sharded gradients alike.
        coef = min(1.0, max_norm / (float(total) + 1e-6))
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
    return total
