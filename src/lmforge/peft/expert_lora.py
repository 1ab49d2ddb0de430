"""LoRA on an MoE block's grouped experts: one low-rank update per expert on the stacked
3-D weights ``experts.gate_up_proj`` (experts, 2 ffn, dim) and ``experts.down_proj``
(experts, dim, ffn), the math of peft's ``LoraConfig(target_parameters=[...])``
(``lora.ParamWrapper``, peft 0.21) on transformers 5's fused experts::

    W'_e = W_e + scaling * B_e A_e        A_e: (rank, in)  B_e: (out, rank), each expert e
    scaling = alpha / rank    (rsLoRA: alpha / sqrt(rank))

A is Kaiming-uniform and B zero at initialisation, so a fresh adapter changes nothing.
Dropout is refused, as peft refuses it (peft folds B A into the weight, which leaves no
input of the adapter's own to drop): an adapter trained with it would not be peft's.

``apply_expert_lora`` swaps ``moe.experts`` for ``LoraGroupedExperts``, which keeps the
base weights (and gpt-oss's biases, which LoRA leaves alone) at their names, so base
checkpoints load unchanged, and holds the adapters beside them::

    experts.lora.gate_up_proj.lora_a   (experts, rank, dim)
    experts.lora.gate_up_proj.lora_b   (experts, 2 ffn, rank)
    experts.lora.down_proj.lora_a      (experts, rank, ffn)
    experts.lora.down_proj.lora_b      (experts, dim, rank)

(one expert per row of dim 0, so expert parallelism shards adapters as it shards weights).
On a meta block, call ``init_expert_lora`` after ``to_empty``; ``merge_expert_lora`` adds
the updates into the weights and puts a plain ``GroupedExperts`` back.

peft stores the same numbers differently: per target, ``lora_A.weight`` (experts * rank,
in) expert-major (row e * rank + i is expert e's i-th row of A), ``lora_B.weight`` (out,
rank * experts) expert-minor (column i * experts + e is expert e's i-th column of B); the
wrappers nest, one per targeted parameter in the module's registration order, so every
target but the last gains a ``base_layer.`` per later one, e.g. for Qwen3-MoE with both::

    base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight   gate_up_proj
    base_model.model.model.layers.0.mlp.experts.lora_A.weight              down_proj

``to_peft`` / ``from_peft`` convert (names and layout): for Qwen3-MoE, Mixtral and
DeepSeek-V3 (``moe_hf``'s ``fused``) as above; for gpt-oss, whose experts transformers
stores transposed (experts, in, out) with gate and up outputs interleaved, peft keeps A
and B in the same shapes (it reads ``is_transposed``), and B's rows of gate_up_proj are
interleaved as the outputs are.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from lmforge.models.grouped_mm import grouped_linear
from lmforge.models.moe import GroupedExperts, MoE
from lmforge.peft.quant_experts import QuantizableExperts
from lmforge.peft.scaling import PEFT_PREFIX, is_lora_param, lora_scaling

EXPERT_TARGETS = ("gate_up_proj", "down_proj")  # the registration order peft nests by


class ExpertLora(nn.Module):
    """The adapters of one stacked expert weight (experts, out, in)."""

    def __init__(self, n_experts: int, out_features: int, in_features: int, rank: int,
                 alpha: float, rslora: bool = False, device=None, dtype=None):
        super().__init__()
        self.rank, self.alpha, self.rslora = rank, float(alpha), rslora
        self.lora_a = nn.Parameter(torch.empty(n_experts, rank, in_features,
                                               device=device, dtype=dtype))
        self.lora_b = nn.Parameter(torch.empty(n_experts, out_features, rank,
                                               device=device, dtype=dtype))
        if not self.lora_a.is_meta:
            self.reset_parameters()

    @property
    def scaling(self) -> float:
        return lora_scaling(self.alpha, self.rank, self.rslora)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """peft's kaiming_uniform_(a=sqrt(5)) on its (experts * rank, in) A draws from
        U(-1/sqrt(in), 1/sqrt(in)); on our 3-D A, kaiming would take rank * in as the
        fan-in, so the bound is written out. A split over expert-parallel ranks (a
        DTensor) takes its part of the whole stack's draws: the same adapter as one
        process's, whatever the layout."""
        bound = 1.0 / math.sqrt(self.lora_a.shape[-1])
        whole = torch.empty(self.lora_a.shape, dtype=self.lora_a.dtype,
                            device=self.lora_a.device).uniform_(-bound, bound)
        _copy_whole(self.lora_a, whole)
        nn.init.zeros_(self.lora_b)

    def delta(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """scaling * B A, the (experts, out, in) update merging adds."""
        return torch.bmm(self.lora_b.to(dtype), self.lora_a.to(dtype)) * self.scaling

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha:g}, rslora={self.rslora}"


def _copy_whole(param: torch.Tensor, whole: torch.Tensor) -> None:
    """Writes ``whole`` (the full tensor) into ``param``: this rank's part of it where
    ``param`` is a DTensor."""
    if isinstance(param, DTensor):
        part = distribute_tensor(whole, param.device_mesh, param.placements,
                                 src_data_rank=None)  # (each rank cuts its own part)
        param.to_local().copy_(part.to_local())
    else:
        param.copy_(whole)


class LoraGroupedExperts(QuantizableExperts):
    """``GroupedExperts`` whose chosen stacked weights carry per-expert LoRA adapters
    (``lora``: target name -> ``ExpertLora``).

    A targeted product is the base's plus two rank-wide grouped products, x A_e^T then
    B_e, scaled: no adapted copy of the stack is made. (peft's ParamWrapper folds B A
    into a fresh copy of the whole stack every forward and keeps it for the backward: for
    Qwen3-30B-A3B, 48 layers' gate_up and down stacks, about 58 GB in bf16.) A rank whose
    rows are not 16-byte aligned (rank 4 in bf16) takes the padded product
    (``models.grouped_mm``)."""

    @classmethod
    def from_experts(cls, experts: GroupedExperts, targets: Sequence[str], rank: int,
                     alpha: float, rslora: bool = False) -> "LoraGroupedExperts":
        """Wrap ``experts``, reusing its parameter tensors (no copy; meta stays meta; a
        quantized stack stays quantized)."""
        new = cls.wrap(experts)
        new.disabled = False  # (peft.lora.adapters_disabled: the base experts alone)
        new.lora = nn.ModuleDict()
        for name in EXPERT_TARGETS:  # peft's nesting order, whatever order was asked
            if name in targets:
                new.add_adapter(name, rank, alpha, rslora)
        return new

    def add_adapter(self, name: str, rank: int, alpha: float,
                    rslora: bool = False) -> ExpertLora:
        """A fresh adapter (A uniform, B zero; empty on meta) on stack ``name``, replacing
        any it had."""
        if self.is_quantized(name):  # adapters in the stack's own dtype beside its codes
            device, dtype = self.quantized[name].device(), self.quantized[name].base_dtype
        else:
            device, dtype = getattr(self, name).device, getattr(self, name).dtype
        self.lora[name] = ExpertLora(*self.stack_shape(name), rank, alpha, rslora,
                                     device=device, dtype=dtype)
        return self.lora[name]

    def expert_stacks(self) -> list[tuple[nn.Module, str]]:
        """The base's stacks and every adapter's A and B (one expert per row of dim 0)."""
        return super().expert_stacks() + [(adapter, name) for adapter in self.lora.values()
                                          for name in ("lora_a", "lora_b")]

    def product(self, name: str, rows: torch.Tensor, counts: torch.Tensor,
                experts: torch.Tensor) -> torch.Tensor:
        """The base stack's grouped product (dequantized where quantized), plus, where
        ``name`` is adapted, scaling * (rows A_e^T) B_e^T for each row's expert e."""
        out = grouped_linear(rows, self.weight_of(name), counts, experts)  # (rows, out)
        if name not in self.lora or self.disabled:
            return out
        adapter = self.lora[name]
        a = self.local(adapter.lora_a).to(rows.dtype)
        b = self.local(adapter.lora_b).to(rows.dtype)
        low = grouped_linear(rows, a, counts, experts)  # (rows, rank)
        return out + adapter.scaling * grouped_linear(low.to(rows.dtype), b, counts, experts)


# ------------------------------------------------------------------------ block API

def apply_expert_lora(moe: MoE, targets: Sequence[str] = EXPERT_TARGETS, rank: int = 8,
                      alpha: float = 16.0, dropout: float = 0.0,
                      rslora: bool = False) -> LoraGroupedExperts:
    """Swap ``moe.experts`` for a ``LoraGroupedExperts`` adapting ``targets`` and freeze
    every other parameter of the block (router, expert weights and biases, shared
    experts; LoRA layers' own ``lora_a``/``lora_b`` stay trainable). Returns the new
    experts module."""
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    bad = [t for t in targets if t not in EXPERT_TARGETS]
    if bad or not targets:
        what = f"{bad[0]!r} is not" if bad else "none given; each must be"
        raise ValueError(f"expert LoRA targets: {what} one of {', '.join(EXPERT_TARGETS)}")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise ValueError(f"expert LoRA rank: must be a positive integer, got {rank!r}")
    if dropout:
        raise ValueError(f"expert LoRA dropout: {dropout} is not supported on grouped "
                         f"experts (peft's target_parameters adapters take none: it folds "
                         f"them into the weight)")
    if not isinstance(getattr(moe, "experts", None), GroupedExperts):
        raise ValueError(f"apply_expert_lora: {type(moe).__name__} has no GroupedExperts "
                         f"at .experts")
    if isinstance(moe.experts, LoraGroupedExperts):
        raise ValueError("apply_expert_lora: the experts already have LoRA adapters")
    moe.experts = LoraGroupedExperts.from_experts(moe.experts, targets, rank, alpha, rslora)
    for name, param in moe.named_parameters():
        param.requires_grad_(is_lora_param(name))
    return moe.experts


@torch.no_grad()
def init_expert_lora(module: nn.Module) -> int:
    """A uniform, B zero in every expert adapter under ``module`` (after ``to_empty`` of
    a block the adapters were added to on the meta device). Returns how many."""
    adapters = [m for m in module.modules() if isinstance(m, ExpertLora)]
    for adapter in adapters:
        adapter.reset_parameters()
    return len(adapters)


@torch.no_grad()
def merge_expert_lora(moe: MoE) -> GroupedExperts:
    """Add every adapter into its stacked weight (in fp32, cast back to the weight's
    dtype) and put a plain ``GroupedExperts`` holding the same parameters back in place:
    the block's state dict is the base model's again. Returns the new experts module."""
    lora_experts = moe.experts
    if not isinstance(lora_experts, LoraGroupedExperts):
        raise ValueError("merge_expert_lora: the experts have no LoRA adapters")
    if lora_experts.quantized is not None:
        raise ValueError(f"cannot merge LoRA into {lora_experts.quantized_format()}-"
                         f"quantized expert stacks; "
                         f"dequantize them to 16-bit first (dequantize_base) or export "
                         f"with export_merged, which does")
    for name, adapter in lora_experts.lora.items():
        weight = getattr(lora_experts, name)
        weight.add_(adapter.delta(torch.float32).to(weight.dtype))
    plain = GroupedExperts.__new__(GroupedExperts)
    nn.Module.__init__(plain)
    plain.args = lora_experts.args
    for name in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
        setattr(plain, name, getattr(lora_experts, name))
    moe.experts = plain
    return plain


# ------------------------------------------------------------------- peft's names

def peft_names(targets: Sequence[str], prefix: str) -> dict[str, str]:
    """Our block-level adapter names -> peft's keys, for the block at ``prefix`` (its
    HF module name with a trailing dot, e.g. ``model.layers.0.mlp.``). Pure: names only."""
    present = [t for t in EXPERT_TARGETS if t in targets]
    names = {}
    for i, target in enumerate(present):
        module = PEFT_PREFIX + prefix + "experts" + ".base_layer" * (len(present) - 1 - i)
        names[f"experts.lora.{target}.lora_a"] = f"{module}.lora_A.weight"
        names[f"experts.lora.{target}.lora_b"] = f"{module}.lora_B.weight"
    return names


def _targets_in(sd: dict[str, torch.Tensor]) -> list[str]:
    return [t for t in EXPERT_TARGETS if f"experts.lora.{t}.lora_a" in sd]


def to_peft(sd: dict[str, torch.Tensor], prefix: str,
            layout: str = "fused") -> dict[str, torch.Tensor]:
    """One block's adapters (our names, as ``experts.lora.<target>.lora_a``) in peft's
    keys and layout: A (experts, rank, in) -> (experts * rank, in); B (experts, out,
    rank) -> (out, rank * experts), expert-minor. ``layout``: of transformers' experts
    (``moe_hf``); gpt-oss's gate_up_proj interleaves gate and up outputs, and so do the
    rows of its B."""
    names = peft_names(_targets_in(sd), prefix)
    out = {}
    for ours, theirs in names.items():
        t = sd[ours]
        if ours.endswith("lora_a"):
            out[theirs] = t.reshape(-1, t.shape[-1]).contiguous()  # (experts * rank, in)
        else:
            if layout == "gpt_oss" and ".gate_up_proj." in ours:
                gate, up = t.chunk(2, dim=1)
                t = torch.stack((gate, up), dim=2).flatten(1, 2)  # rows: gate, up, gate, ...
            b = t.permute(1, 2, 0)  # (out, rank, experts): experts the fastest
            out[theirs] = b.flatten(1).contiguous()  # (out, rank * experts)
    return out


def from_peft(sd: dict[str, torch.Tensor], prefix: str, n_experts: int,
              targets: Sequence[str] = EXPERT_TARGETS,
              layout: str = "fused") -> dict[str, torch.Tensor]:
    """``to_peft``'s inverse for the block at ``prefix``: peft's keys for ``targets``
    (all must be there; other keys are ignored) in our names and layout."""
    out = {}
    for ours, theirs in peft_names(targets, prefix).items():
        if theirs not in sd:
            raise ValueError(f"{theirs}: missing from the peft state dict (targets "
                             f"{', '.join(targets)})")
        t = sd[theirs]
        if t.ndim != 2 or (t.shape[0] if ours.endswith("lora_a") else t.shape[1]) % n_experts:
            raise ValueError(f"{theirs}: shape {tuple(t.shape)} does not split into "
                             f"{n_experts} experts")
        if ours.endswith("lora_a"):
            out[ours] = t.reshape(n_experts, -1, t.shape[-1]).contiguous()  # (experts, rank, in)
        else:
            b = t.unflatten(1, (-1, n_experts)).permute(2, 0, 1)  # (experts, out, rank)
            if layout == "gpt_oss" and ".gate_up_proj." in ours:
                b = torch.cat((b[:, 0::2], b[:, 1::2]), dim=1)  # gate rows, then up
            out[ours] = b.contiguous()
    return out
