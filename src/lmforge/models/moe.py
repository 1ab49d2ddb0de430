"""The mixture-of-experts block of Qwen3-MoE, Mixtral, gpt-oss, DeepSeek-V3 and Qwen3-Next: a
router picks ``top_k`` of ``n_experts`` gated MLPs per token, the chosen experts run as one
grouped product per projection, their outputs are summed by the router's weights, and
DeepSeek-V3 and Qwen3-Next add always-on shared experts. Beside it: the load-balancing loss
(Switch Transformer's, as transformers computes it), the expert-load statistic and
DeepSeek-V3's aux-loss-free bias update (each family's HF tensors: ``models/moe_hf.py``).

The families differ only in ``MoEArgs``:

=============  ===================  ===============================================
family         router               other fields
=============  ===================  ===============================================
Qwen3-MoE      softmax_topk         norm_topk_prob as config.json says
Mixtral        softmax_topk         norm_topk_prob=True (always renormalised)
gpt-oss        topk_softmax         router_bias, expert_bias, clamped_swiglu
DeepSeek-V3    sigmoid_group_topk   n_groups, topk_groups, norm_topk_prob,
                                    routed_scaling_factor, n_shared_experts
Qwen3-Next     softmax_topk         shared_ffn_dim, shared_expert_gate
=============  ===================  ===============================================

Mixtral's ``router_jitter_noise`` (training-time noise on the router's input, 0 in the
released configs) is not modelled: a family should refuse a config that sets it.

Weight layout (the block's own names are transformers 5's for Qwen3-MoE, Mixtral and
DeepSeek-V3, so their mapping is the identity; ``moe_hf.from_hf`` converts gpt-oss's and
the per-expert checkpoint files'):

- ``gate.weight`` (experts, dim); gpt-oss's ``gate.bias`` (experts,); DeepSeek-V3's
  buffer ``gate.e_score_correction_bias`` (experts,), fp32.
- ``experts.gate_up_proj`` (experts, 2 * ffn, dim): each expert's ``nn.Linear`` weight
  (out x in) with the gate's rows first, then the up projection's.
- ``experts.down_proj`` (experts, dim, ffn).
- gpt-oss: ``experts.gate_up_proj_bias`` (experts, 2 * ffn), gate then up;
  ``experts.down_proj_bias`` (experts, dim).
- DeepSeek-V3: ``shared_experts.{gate,up,down}_proj.weight``, a ``GatedMLP`` of width
  ``n_shared_experts * ffn``; Qwen3-Next's, Qwen3.5-MoE's: ``shared_ffn_dim`` wide, and
  ``shared_expert_gate.weight`` (1, dim).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.models.common import GatedMLP
from lmforge.models.grouped_mm import grouped_linear, tokens_per_expert

__all__ = ["MoE", "MoEArgs", "Routing", "Router", "GroupedExperts", "grouped_linear",
           "tokens_per_expert", "load_balancing_loss", "max_load_ratio", "take_routings",
           "update_correction_bias", "check_ep"]

ROUTERS = ("softmax_topk", "topk_softmax", "sigmoid_group_topk")
ACTIVATIONS = ("swiglu", "clamped_swiglu")


def check_ep(n_experts: int, ep: int) -> None:
    """Refuses an ep that does not split the experts evenly (one line, naming the key):
    the config's check (``models.presets.check_layout_fits``) and ``parallel.expert``'s."""
    if ep <= 0 or n_experts % ep:
        raise ValueError(f"parallel.ep: {ep} does not divide the model's {n_experts} "
                         f"experts (each rank keeps n_experts / ep of them)")


@dataclass(frozen=True)
class MoEArgs:
    """One MoE block. The comments give the config.json field each reads."""
    dim: int  # hidden_size
    n_experts: int  # num_experts (Qwen3-MoE), num_local_experts, n_routed_experts
    top_k: int  # num_experts_per_tok
    ffn_dim: int  # an expert's width: moe_intermediate_size; Mixtral, gpt-oss: intermediate_size
    router: str = "softmax_topk"  # one of ROUTERS
    norm_topk_prob: bool = True  # the k chosen weights rescaled to sum to 1
    router_bias: bool = False  # gpt-oss: the router's linear has a bias
    activation: str = "swiglu"  # one of ACTIVATIONS
    expert_bias: bool = False  # gpt-oss: the experts' projections have biases
    swiglu_alpha: float = 1.702  # gpt-oss's clamped SwiGLU: glu = x * sigmoid(alpha x)
    swiglu_limit: float = 7.0  # ... with the gate clamped above, up on both sides
    n_groups: int = 1  # DeepSeek-V3: n_group, the experts split into this many groups
    topk_groups: int = 1  # DeepSeek-V3: topk_group, the groups a token may choose from
    routed_scaling_factor: float = 1.0  # DeepSeek-V3: the routed weights' multiplier
    n_shared_experts: int = 0  # DeepSeek-V3: the always-on experts' count; Qwen: 1
    shared_ffn_dim: int = 0  # Qwen: shared_expert_intermediate_size (0: n_shared * ffn_dim)
    shared_expert_gate: bool = False  # Qwen: shared output * sigmoid(linear(x)), per token

    def __post_init__(self):
        for name in ("dim", "n_experts", "top_k", "ffn_dim", "n_groups", "topk_groups"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: {value!r} is not a positive integer")
        if self.router not in ROUTERS:
            raise ValueError(f"router: {self.router!r} is not one of {', '.join(ROUTERS)}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation: {self.activation!r} is not one of "
                             f"{', '.join(ACTIVATIONS)}")
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k: {self.top_k} > n_experts {self.n_experts}: a token "
                             f"cannot choose more experts than there are")
        if self.n_shared_experts < 0:
            raise ValueError(f"n_shared_experts: {self.n_shared_experts} is negative")
        if self.router == "sigmoid_group_topk":
            self._check_groups()

    @property
    def shared_width(self) -> int:  # the shared experts' width as one gated MLP (0: none)
        return self.shared_ffn_dim or self.n_shared_experts * self.ffn_dim

    def _check_groups(self) -> None:
        if self.n_experts % self.n_groups or self.n_experts // self.n_groups < 2:
            raise ValueError(f"n_groups: {self.n_groups} does not split n_experts "
                             f"{self.n_experts} into groups of 2 or more (a group's score "
                             f"is the sum of its best two)")
        if self.topk_groups > self.n_groups:
            raise ValueError(f"topk_groups: {self.topk_groups} > n_groups {self.n_groups}")
        open_experts = self.topk_groups * (self.n_experts // self.n_groups)
        if self.top_k > open_experts:
            raise ValueError(f"top_k: {self.top_k} > the {open_experts} experts of "
                             f"topk_groups {self.topk_groups} groups")


class Routing(NamedTuple):
    """A router's choice for each token."""
    indices: torch.Tensor  # (tokens, top_k) long: the chosen experts
    weights: torch.Tensor  # (tokens, top_k) fp32: each chosen expert's share of the output
    logits: torch.Tensor  # (tokens, experts) fp32: what the load-balancing loss reads


# ------------------------------------------------------------------------------ routers

def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool):
    """Qwen3-MoE, Mixtral: the k most probable experts under a softmax over all of them."""
    probs = logits.softmax(dim=-1)  # (tokens, experts)
    weights, indices = probs.topk(top_k, dim=-1)  # (tokens, top_k)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return indices, weights


def topk_softmax(logits: torch.Tensor, top_k: int):
    """gpt-oss: the k largest logits, then a softmax over those k only."""
    top, indices = logits.topk(top_k, dim=-1)  # (tokens, top_k)
    return indices, top.softmax(dim=-1)


def sigmoid_group_topk(logits: torch.Tensor, correction: torch.Tensor, args: MoEArgs):
    """DeepSeek-V3: independent sigmoid scores; the correction bias (aux-loss-free
    balancing) shifts which experts are chosen but not their weights. A token first
    keeps the ``topk_groups`` groups whose best two corrected scores sum highest (which
    bounds how many devices it is sent to under expert parallelism), then takes its
    ``top_k`` experts among those groups' experts."""
    scores = logits.sigmoid()  # (tokens, experts)
    choice = (scores + correction).unflatten(-1, (args.n_groups, -1))  # (tokens, groups, per_group)
    group_scores = choice.topk(2, dim=-1).values.sum(dim=-1)  # (tokens, groups)
    groups = group_scores.topk(args.topk_groups, dim=-1).indices  # (tokens, topk_groups)
    kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
    choice = choice.masked_fill(~kept.unsqueeze(-1), float("-inf")).flatten(1)  # (tokens, experts)
    indices = choice.topk(args.top_k, dim=-1).indices  # (tokens, top_k)
    weights = scores.gather(1, indices)  # (tokens, top_k)
    if args.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return indices, weights * args.routed_scaling_factor


class Router(nn.Module):
    """A linear map to one logit per expert, then the family's choice of ``top_k``. It
    runs in fp32 whatever the model's dtype (DeepSeek-V3 does so; the others' softmax is
    in fp32 already): a rounding error here changes which expert is chosen."""

    def __init__(self, args: MoEArgs):
        super().__init__()
        self.args = args
        self.weight = nn.Parameter(torch.empty(args.n_experts, args.dim))
        self.bias = nn.Parameter(torch.empty(args.n_experts)) if args.router_bias else None
        if args.router == "sigmoid_group_topk":
            # A buffer, not a parameter: update_correction_bias sets it, not the optimizer.
            # Keep it fp32 when the model is cast: bf16 rounds its 0.001 steps away.
            self.register_buffer("e_score_correction_bias",
                                 torch.zeros(args.n_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> Routing:
        """x: (tokens, dim)."""
        bias = None if self.bias is None else self.bias.float()
        with torch.autocast(x.device.type, enabled=False):  # (fp32 under autocast too)
            logits = F.linear(x.float(), self.weight.float(), bias)  # (tokens, experts)
        if self.args.router == "softmax_topk":
            indices, weights = softmax_topk(logits, self.args.top_k, self.args.norm_topk_prob)
        elif self.args.router == "topk_softmax":
            indices, weights = topk_softmax(logits, self.args.top_k)
        else:
            indices, weights = sigmoid_group_topk(logits, self.e_score_correction_bias,
                                                  self.args)
        return Routing(indices, weights, logits)

    def reset_parameters(self, std: float) -> None:
        nn.init.trunc_normal_(self.weight, std=std, a=-3 * std, b=3 * std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)
        if self.args.router == "sigmoid_group_topk":
            nn.init.zeros_(self.e_score_correction_bias)


def swiglu(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def clamped_swiglu(h: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's: the gate clamped from above and up on both sides, so no expert's output
    can blow up, and up shifted by one."""
    gate, up = h.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GroupedExperts(nn.Module):
    """``n_experts`` gated MLPs stored as stacked 3-D weights (layout in the module's
    docstring). The (token, k) assignments are sorted by expert so that each projection
    is one grouped product over contiguous rows: no loop over tokens or experts, and no
    expert computes a token it was not given."""

    def __init__(self, args: MoEArgs):
        super().__init__()
        self.args = args
        e, d, f = args.n_experts, args.dim, args.ffn_dim
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * f, d))
        self.down_proj = nn.Parameter(torch.empty(e, d, f))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * f)) if args.expert_bias else None
        self.down_proj_bias = nn.Parameter(torch.empty(e, d)) if args.expert_bias else None

    def forward(self, x: torch.Tensor, indices: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
        """x: (tokens, dim); indices, weights: (tokens, top_k) from the router."""
        flat = indices.flatten()  # (assignments,) = tokens * top_k
        order = flat.argsort(stable=True)  # assignments grouped by expert, tokens in order
        experts = flat[order]  # (assignments,)
        counts = tokens_per_expert(flat, self.args.n_experts)  # (experts,)
        tokens = order // indices.shape[1]  # (assignments,) the token each one reads
        h = self.product("gate_up_proj", x[tokens], counts, experts)  # (assignments, 2 ffn)
        if self.gate_up_proj_bias is not None:
            h = h + self.gate_up_proj_bias[experts]
        h = self.activate(h)  # (assignments, ffn)
        y = self.product("down_proj", h, counts, experts)  # (assignments, dim)
        if self.down_proj_bias is not None:
            y = y + self.down_proj_bias[experts]
        y = y * weights.flatten()[order].unsqueeze(-1).to(y.dtype)
        return x.new_zeros(x.shape).index_add(0, tokens, y.to(x.dtype))  # (tokens, dim)

    def product(self, name: str, rows: torch.Tensor, counts: torch.Tensor,
                experts: torch.Tensor) -> torch.Tensor:
        """Each of ``rows`` (sorted by expert) times its expert's ``name`` weight: one
        grouped product (CPU decoding packs the experts' weights and replaces this for its
        length: ``models.packed_linear``)."""
        return grouped_linear(rows, self.weight_of(name), counts, experts)

    def weight_of(self, name: str) -> torch.Tensor:
        """The stacked weight ``name`` as the forward multiplies by it (an adapter's
        subclass, ``peft.expert_lora``, returns it adapted)."""
        return getattr(self, name)

    def expert_stacks(self) -> list[tuple[nn.Module, str]]:
        """(owner, parameter name) of every parameter stacked by expert (dim 0 = the
        expert): the weights, gpt-oss's biases, and in a subclass its adapters. Expert
        parallelism splits exactly these (``parallel.expert``)."""
        names = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")
        return [(self, n) for n in names if getattr(self, n, None) is not None]

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """The experts of stacked tensor ``t`` this module computes with: all of them
        here; expert parallelism's forward takes this rank's shard."""
        return t

    def activate(self, h: torch.Tensor) -> torch.Tensor:
        if self.args.activation == "clamped_swiglu":
            return clamped_swiglu(h, self.args.swiglu_alpha, self.args.swiglu_limit)
        return swiglu(h)

    def reset_parameters(self, std: float, out_std: float) -> None:
        nn.init.trunc_normal_(self.gate_up_proj, std=std, a=-3 * std, b=3 * std)
        nn.init.trunc_normal_(self.down_proj, std=out_std, a=-3 * out_std, b=3 * out_std)
        for bias in (self.gate_up_proj_bias, self.down_proj_bias):
            if bias is not None:
                nn.init.zeros_(bias)


class MoE(nn.Module):
    """The feed-forward of an MoE layer: routed experts, plus shared ones (Qwen's gated).
    ``forward`` returns the output and the ``Routing``, whose logits the model gathers
    over its layers for ``load_balancing_loss`` and whose indices give the expert load."""

    def __init__(self, args: MoEArgs):
        super().__init__()
        self.args = args
        self.gate = Router(args)
        self.experts = GroupedExperts(args)
        shared = args.shared_width
        self.shared_experts = GatedMLP(args.dim, shared, "silu") if shared else None
        gated = shared and args.shared_expert_gate
        self.shared_expert_gate = nn.Linear(args.dim, 1, bias=False) if gated else None
        # The choices of the forwards that build a graph (training's), kept for the trainer's
        # load-balancing loss (``take_routings``): a side channel, so that a block's output stays
        # one tensor for the stack, pipeline stages and activation checkpointing alike.
        # Forwards without gradients (evaluation, generation, a reference model) keep nothing.
        self.routings: list[Routing] = []

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Routing]:
        """x: (..., dim), e.g. (batch, seq, dim)."""
        flat = x.reshape(-1, x.shape[-1])  # (tokens, dim)
        routing = self.gate(flat)
        if torch.is_grad_enabled() and not _in_backward():
            self.routings.append(routing)
        out = self.experts(flat, routing.indices, routing.weights)  # (tokens, dim)
        if self.shared_experts is not None:
            shared = self.shared_experts(flat)  # (tokens, dim)
            if self.shared_expert_gate is not None:  # times (tokens, 1)
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            out = out + shared
        return out.view(x.shape), routing

    @torch.no_grad()
    def reset_parameters(self, std: float, out_std: Optional[float] = None) -> None:
        """Truncated N(0, std) inputs and router; outputs, which add to the residual,
        ``out_std`` (default std; the families pass std / sqrt(2 n_layers) as for their
        dense MLPs); biases and the correction bias zero."""
        out_std = std if out_std is None else out_std
        self.gate.reset_parameters(std)
        self.experts.reset_parameters(std, out_std)
        if self.shared_experts is not None:
            self.shared_experts.reset_parameters(std, out_std)
        if self.shared_expert_gate is not None:
            nn.init.trunc_normal_(self.shared_expert_gate.weight, std=std, a=-3 * std, b=3 * std)


# ------------------------------------------------------------------------- balancing

def _in_backward() -> bool:
    """Whether this forward is activation checkpointing's recomputation, inside a backward:
    its routing must not be kept (it would hold that block's graph until the next forward)."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is not None and current() != -1


def take_routings(model: nn.Module) -> list[Routing]:
    """The ``Routing`` of each MoE layer's forwards with gradients since the last call (not
    activation checkpointing's recomputations), forgotten by the layers; [] if dense."""
    found = []
    for module in model.modules():
        if isinstance(module, MoE):
            found += module.routings
            module.routings = []
    return found


def load_balancing_loss(router_logits: Sequence[torch.Tensor], top_k: int,
                        attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Switch Transformer's auxiliary loss as transformers' ``load_balancing_loss_func``
    computes it: every layer's (tokens, experts) logits pooled, f_e = the assignments to
    expert e (its softmax's top_k) per token row, P_e = its mean softmax probability,
    loss = n_experts * sum_e f_e P_e (sum_e f_e = top_k, so balanced routing gives top_k).
    ``attention_mask`` (batch, seq) or (tokens,), 1 = a real token: padding rows left out.
    (DeepSeek-V3's group limit and bias are not in it, as in transformers.)"""
    n_experts = router_logits[0].shape[-1]
    rows = router_logits[0].shape[0]
    mask = (torch.ones(rows, device=router_logits[0].device) if attention_mask is None
            else attention_mask.reshape(-1).to(router_logits[0].device, torch.float32))
    chosen = torch.zeros(n_experts, device=mask.device)  # (experts,)
    probs_sum = torch.zeros(n_experts, device=mask.device)  # (experts,)
    for logits in router_logits:
        probs = logits.float().softmax(dim=-1)  # (tokens, experts)
        picks = probs.topk(top_k, dim=-1).indices  # (tokens, top_k)
        chosen = chosen.scatter_add(0, picks.flatten(), mask.repeat_interleave(top_k))
        probs_sum = probs_sum + (probs * mask.unsqueeze(-1)).sum(dim=0)
    total_rows = mask.sum() * len(router_logits)
    return n_experts * ((chosen / total_rows) * (probs_sum / total_rows)).sum()


def max_load_ratio(counts: torch.Tensor) -> torch.Tensor:
    """The busiest expert's assignments over the mean expert's, per row of ``counts``
    (..., experts): 1 when balanced, n_experts / top_k when every token picks the same
    experts. A tensor, so logging it costs no device sync until it is read."""
    counts = counts.float()
    return counts.amax(dim=-1) / counts.mean(dim=-1).clamp_min(1e-12)


@torch.no_grad()
def update_correction_bias(router: Router, counts: torch.Tensor, step_size: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing (paper, section 2.1.2): after each
    step, each expert's ``e_score_correction_bias`` moves by ``step_size`` towards the
    mean load, b_e += step_size * sign(mean(load) - load_e): down for an overloaded
    expert, up for an underloaded one, unchanged at the mean. The bias only shifts the
    choice, so no gradient flows through it (DeepSeek-V3 used step_size 0.001). ``counts``
    is the step's ``tokens_per_expert``, summed over micro-batches and, under data
    parallelism, all-reduced first, so every rank applies the same update."""
    if router.args.router != "sigmoid_group_topk":
        raise ValueError(f"router: {router.args.router!r} has no e_score_correction_bias "
                         f"(only sigmoid_group_topk)")
    load = counts.float().to(router.e_score_correction_bias.device)
    router.e_score_correction_bias += step_size * torch.sign(load.mean() - load)
