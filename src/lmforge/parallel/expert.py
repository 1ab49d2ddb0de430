"""Expert parallelism (``parallel.ep``): each of the ep ranks keeps ``n_experts / ep``
consecutive experts (rank r: experts [r E/ep, (r+1) E/ep)) of every stacked weight, and
each forward sends the (token, k) assignments to the rank owning their expert and the
experts' outputs back, with autograd-capable all-to-alls (so the backward runs the same
exchanges reversed). The router stays whole on every rank; no assignment is dropped.

The weights become DTensors ``Shard(0)`` over the 1-D ep mesh, so ``full_tensor()``
gathers a weight or its gradient, and a distributed checkpoint saves and reshards them
as it does tensor parallelism's. The experts' module keeps its class's ``product``,
``activate`` and parameter names (FQNs); ``ExpertParallel`` swaps in a subclass whose
forward exchanges the rows and whose ``weight_of`` gives this rank's shard.

Per forward: one all-to-all of the per-expert counts (splits are uneven, and a receiver
must know which of its experts each arriving row is for), then the rows out and the
outputs back. The split sizes are read on the host: one device sync per forward.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from lmforge.models.moe import GroupedExperts, MoE, check_ep, tokens_per_expert

__all__ = ["ExpertParallel", "check_ep", "expert_parallel_modules", "expert_parallel_params",
           "full_experts_state_dict", "shard_experts"]

class ExpertParallel(ParallelStyle):
    """Applied to a ``GroupedExperts`` (``moe.experts``) over a 1-D ep mesh: its stacked
    weights split by expert (``Shard(0)``), its forward dispatching to their owners. A
    style rather than a function so that a parallelize plan can name it beside the
    tensor-parallel ones, and the weights' mesh rides on them (the forward reads it)."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if not isinstance(module, GroupedExperts):
            raise TypeError(f"ExpertParallel applies to GroupedExperts, "
                            f"not {type(module).__name__}")
        if device_mesh.ndim != 1:
            raise ValueError(f"ExpertParallel takes a 1-D ep mesh, not {device_mesh.ndim}-D")
        check_ep(module.args.n_experts, device_mesh.size())
        for owner, name in module.expert_stacks():  # (with LoRA: the adapters too)
            param = getattr(owner, name)
            if isinstance(param, DTensor):
                continue
            sharded = distribute_tensor(param.data, device_mesh, (Shard(0),))
            owner.register_parameter(name, nn.Parameter(sharded, param.requires_grad))
        module.__class__ = _expert_parallel_class(type(module))
        module.ep_mesh = device_mesh
        return module


def shard_experts(moe: MoE, ep_mesh) -> None:
    """Splits ``moe``'s routed experts over ``ep_mesh`` in place (router and shared
    experts stay whole)."""
    parallelize_module(moe.experts, ep_mesh, ExpertParallel())


def expert_parallel_params(model: nn.Module) -> set[nn.Parameter]:
    """The parameters ``ExpertParallel`` sharded in ``model`` (FSDP2 over the data-parallel
    ranks leaves them to the experts' own unit or alone: ``fully_shard``'s
    ``ignored_params``)."""
    return {param for module in expert_parallel_modules(model)
            for param in module.parameters()}


def expert_parallel_modules(model: nn.Module) -> list[nn.Module]:
    """Every experts module ``ExpertParallel`` applied to in ``model``."""
    return [m for m in model.modules() if isinstance(m, ExpertParallelMixin)]


def full_experts_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s state dict with every sharded tensor gathered whole (a collective:
    every ep rank calls it), detached."""
    return {name: (value.full_tensor() if isinstance(value, DTensor) else value).detach()
            for name, value in module.state_dict().items()}


class ExpertParallelMixin:
    """The forward of ``GroupedExperts`` with its local experts only: the assignments
    sorted by expert (so by owner rank, the experts being consecutive), sent to their
    owners, computed there, sent back, weighted and summed per token as in
    ``GroupedExperts.forward``.

    ``grad_scale``: what the local weights' gradients are multiplied by in backward (the
    trainer's 1 / dp, ``parallel.parallelize.apply_expert_parallel``: FSDP does not
    average them). On the module, not a hook on the parameters: materializing the model
    (``to_empty``) replaces those. ``param_dtype``: what the local weights are cast to
    for the products (FSDP2's mixed precision, which does not reach the parameters it
    ignores); None: as stored."""

    grad_scale: float = 1.0
    param_dtype = None

    def forward(self, x: torch.Tensor, indices: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
        """x: (tokens, dim); indices, weights: (tokens, top_k) from the router."""
        group = self.ep_mesh.get_group()
        flat = indices.flatten()  # (assignments,)
        order = flat.argsort(stable=True)  # assignments grouped by expert, so by rank
        tokens = order // indices.shape[1]  # (assignments,) the token each one reads
        counts = tokens_per_expert(flat, self.args.n_experts)  # (experts,)
        arriving = _exchange_counts(counts, group)  # (ep, local experts) sent to me
        sent = counts.view(arriving.shape).sum(dim=1).tolist()  # rows to each rank
        received = arriving.sum(dim=1).tolist()  # rows from each rank
        rows = all_to_all_single_autograd(x[tokens].contiguous(), received, sent,
                                          group)  # (arrived, dim)
        y = self.local_experts(rows, arriving)  # (arrived, dim)
        y = all_to_all_single_autograd(y.contiguous(), sent, received,
                                       group)  # (assignments, dim), in ``order``
        y = y * weights.flatten()[order].unsqueeze(-1).to(y.dtype)
        return x.new_zeros(x.shape).index_add(0, tokens, y.to(x.dtype))  # (tokens, dim)

    def local_experts(self, rows: torch.Tensor, arriving: torch.Tensor) -> torch.Tensor:
        """The arrived rows (grouped by sender, each sender's by expert) through this
        rank's experts, returned in arrival order. ``arriving`` (ep, local experts): how
        many rows each sender sent each local expert."""
        n_ranks, n_local = arriving.shape
        ids = torch.arange(n_local, device=rows.device).repeat(n_ranks)  # (ep * local,)
        local = ids.repeat_interleave(arriving.flatten().to(rows.device))  # (arrived,)
        regroup = local.argsort(stable=True)  # arrived rows grouped by local expert
        experts = local[regroup]  # (arrived,)
        counts = arriving.sum(dim=0).to(rows.device)  # (local experts,)
        h = self.product("gate_up_proj", rows[regroup], counts, experts)  # (arrived, 2 ffn)
        if self.gate_up_proj_bias is not None:
            h = h + self.local(self.gate_up_proj_bias)[experts]
        h = self.activate(h)  # (arrived, ffn)
        y = self.product("down_proj", h, counts, experts)  # (arrived, dim)
        if self.down_proj_bias is not None:
            y = y + self.local(self.down_proj_bias)[experts]
        return y[regroup.argsort()]  # (arrived, dim) back in arrival order

    def weight_of(self, name: str) -> torch.Tensor:
        """This rank's experts of the stacked weight ``name`` (local expert ids)."""
        return self.local(super().weight_of(name))

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``t`` in ``param_dtype``, its gradient times ``grad_scale``."""
        t = _local(t) if self.param_dtype is None else _local(t).to(self.param_dtype)
        return t if self.grad_scale == 1.0 else _ScaleGrad.apply(t, self.grad_scale)


@functools.cache
def _expert_parallel_class(base: type) -> type:
    """``base`` (GroupedExperts or an adapter's subclass) with the expert-parallel
    forward: one class per base, so a swapped module keeps its base's other methods."""
    return type(f"ExpertParallel{base.__name__}", (ExpertParallelMixin, base), {})


def _exchange_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """(ep, local experts): row s = how many assignments rank s sends to each of this
    rank's experts, from every rank's ``counts`` (experts,). No gradient: counts."""
    arriving = torch.empty_like(counts)
    dist.all_to_all_single(arriving, counts.contiguous(), group=group)
    return arriving.view(dist.get_world_size(group), -1)


class _ScaleGrad(torch.autograd.Function):
    """The identity, its gradient times ``scale``."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t
