"""Training FLOPs per token and the devices' peak FLOP/s, the two halves of MFU.

FLOPs are *model* FLOPs: the matrix multiplies a training step needs, counted from the
model's shape and from which weights take gradients (docs/metrics.md derives them). For
full training they reduce to the familiar

    6 * N_matmul + 6 * n_layers * seq_len * dim              per token, causal attention

where N_matmul counts the weights that take part in matrix multiplies (every linear layer
and the output head; the embedding lookup does none) and the attention term is the
12 * L * S * d of the score and value products halved because a causal mask leaves the
upper triangle out. Frozen weights (LoRA/QLoRA base) cost no weight-gradient FLOPs, and no
input gradient is computed where nothing upstream needs one. Recomputation under activation
checkpointing is not model FLOPs, so MFU does not count it.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch

from lmforge.models.registry import family_of
from lmforge.peft.targets import LoraSpec, lora_spec
from lmforge.perf import linear_attention
from lmforge.perf.mla import latent_attention, mla_flops

# --------------------------------------------------------------------------- peaks

# Dense (no 2:4 sparsity) bf16 tensor-core peaks in TFLOP/s from the vendors' data sheets
# (the sheets print the sparse figure first; these are half of it). A rule matches when
# every one of its words is a word of torch.cuda.get_device_name(); the first match wins,
# so the more specific rules come first.
PEAK_BF16_TFLOPS: list[tuple[tuple[str, ...], float]] = [
    (("GB200",), 2500.0),
    (("B200",), 2250.0),
    (("GH200",), 989.0),
    (("H200", "NVL"), 835.0),
    (("H200",), 989.0),
    (("H100", "NVL"), 835.0),
    (("H100", "PCIe"), 756.0),
    (("H100", "SXM5"), 989.0),
    (("H100", "SXM"), 989.0),
    (("H100", "HBM3"), 989.0),  # "NVIDIA H100 80GB HBM3" is the SXM5 part
    (("H800", "PCIe"), 756.0),
    (("H800",), 989.0),
    (("A100",), 312.0),
    (("A800",), 312.0),
    (("L40S",), 362.0),
    (("L40",), 181.0),
    (("L4",), 121.0),
    (("A10",), 125.0),
    (("MI325X",), 1307.0),
    (("MI300X",), 1307.0),
    (("MI250X",), 383.0),
    (("MI250",), 362.0),
]
PEAK_ENV = "LMFORGE_PEAK_TFLOPS"


def _words(name: str) -> set[str]:
    return set(name.replace("-", " ").replace("_", " ").upper().split())


def match_peak_tflops(device_name: str) -> Optional[float]:
    """Dense bf16 peak (TFLOP/s) of a device called ``device_name``, None when unknown."""
    words = _words(device_name)
    for rule, tflops in PEAK_BF16_TFLOPS:
        if all(w.upper() in words for w in rule):
            return tflops
    return None


def device_peak_flops(device: torch.device) -> Optional[float]:
    """Dense bf16 peak of one device in FLOP/s, or None: on the CPU (no MFU), and on an
    accelerator not in the table, with a warning saying MFU is omitted and how to set it.
    ``LMFORGE_PEAK_TFLOPS`` overrides the table (for an unknown part, or other clocks)."""
    device = torch.device(device)
    override = os.environ.get(PEAK_ENV)
    if override:
        try:
            value = float(override)
        except ValueError:
            raise ValueError(f"{PEAK_ENV}={override!r}: expected a number of TFLOP/s") from None
        return value * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    tflops = match_peak_tflops(name)
    if tflops is None:
        warnings.warn(f"MFU omitted: accelerator {name!r} is not in the dense bf16 peak "
                      f"table (lmforge/perf/flops.py PEAK_BF16_TFLOPS); set {PEAK_ENV} "
                      "to its dense bf16 peak in TFLOP/s to report MFU", stacklevel=2)
        return None
    return tflops * 1e12


# ------------------------------------------------------------------- trainability

@dataclass(frozen=True)
class Trainability:
    """Which weights take gradients, and which projections carry a LoRA adapter."""
    embedding: bool = True
    norms: bool = True
    head: bool = True
    linears: Optional[frozenset] = None  # projections whose weight trains; None: all
    adapters: tuple = ()  # ((projection, rank), ...)

    @classmethod
    def full(cls) -> "Trainability":
        return cls()

    @classmethod
    def lora(cls, spec: LoraSpec, present: Optional[set] = None) -> "Trainability":
        """``present``: the model's projections, where a target may name one it lacks
        (DeepSeek-V3's q_proj beside q_a_proj and q_b_proj)."""
        return cls(embedding=False, norms=False, head=False, linears=frozenset(),
                   adapters=tuple((t, spec.rank) for t in spec.targets
                                  if present is None or t in present))

    @classmethod
    def from_model(cls, model: Any) -> "Trainability":
        """Read from a built model (a ``Llama``, a pipeline stage of one, or the trainer's
        ``TrainModel`` holding ``parts``): ``requires_grad`` of each weight, and LoRA
        adapters (``lora_a``/``lora_b`` beside a projection's ``weight``, modules or
        tensors; an MoE's ``experts.lora.<weight>``). A mixture of experts is read off its
        first dense and first sparse layer: the router, the stacked experts and the shared
        experts train or not under the names ``MOE_PARTS`` gives them. Parts this rank does
        not hold are taken to train like its norms."""
        parts = list(getattr(model, "parts", None) or [model])
        layers = [layer for part in parts for layer in part.layers.values()]
        layer = layers[0]
        present, linears, adapters = set(), set(), []
        projections = family_of(parts[0].args).projections
        for group in _projection_groups(layers):
            for name in projections.all + linear_attention.LINEAR_PROJECTIONS:
                proj = getattr(group, name, None)
                if proj is None or name in present:
                    continue
                present.add(name)
                weight = getattr(proj, "weight", None)
                if isinstance(weight, torch.nn.Parameter) and weight.requires_grad:
                    linears.add(name)
                lora_a = getattr(proj, "lora_a", None)
                if lora_a is not None:
                    a = getattr(lora_a, "weight", lora_a)
                    adapters.append((name, int(min(a.shape))))
        order = projections.all + linear_attention.LINEAR_PROJECTIONS  # (lora.targets')
        adapters.sort(key=lambda pair: order.index(pair[0]))
        moe = _moe_trainability(layers, projections.experts)
        present |= moe[0]
        linears |= moe[1]
        adapters += moe[2]
        norms = layer.attention_norm.weight.requires_grad

        def trains(attr: str) -> bool:
            for part in parts:
                module = getattr(part, attr, None)
                weight = getattr(module, "weight", None) if module is not None else None
                if weight is not None:
                    return bool(weight.requires_grad)
            return norms

        return cls(embedding=trains("tok_embeddings"), norms=norms, head=trains("output"),
                   linears=None if linears == present else frozenset(linears),
                   adapters=tuple(adapters))

    def rank(self, projection: str) -> int:
        return dict(self.adapters).get(projection, 0)

    def trains(self, projection: str) -> bool:
        return self.linears is None or projection in self.linears


# The parts of an MoE block as Trainability names them: the router, the stacked experts
# (the family's ``Projections.experts`` names, which LoRA targets use) and the shared
# experts (one GatedMLP).
ROUTER, SHARED_EXPERTS = "router", "shared_experts"


def _projection_groups(layers: list) -> list:
    """The attention and dense MLP of the first layer, and the first dense layer's MLP
    when the first layer is an MoE (Qwen3-MoE's dense layers may come later)."""
    groups = [layers[0].attention, layers[0].feed_forward]
    # a hybrid's first layer of each kind of attention (a Gated DeltaNet, a full one)
    groups += list({type(lay.attention): lay.attention for lay in reversed(layers)}.values())
    dense = [lay.feed_forward for lay in layers if not hasattr(lay.feed_forward, "experts")]
    return groups + dense[:1]


def _moe_trainability(layers: list, expert_names: tuple) -> tuple[set, set, list]:
    """(present, trained, adapters) of the first MoE layer among ``layers``: the router,
    each stacked expert weight (its LoRA adapters: ``experts.lora.<weight>``, rank from
    ``lora_a`` (experts, rank, in)) and the shared experts."""
    moe = next((lay.feed_forward for lay in layers if hasattr(lay.feed_forward, "experts")),
               None)
    present, trained, adapters = set(), set(), []
    if moe is None:
        return present, trained, adapters
    parts = {ROUTER: moe.gate.weight}
    for name in expert_names:
        parts[name] = getattr(moe.experts, name.removeprefix("experts."))
    if getattr(moe, "shared_experts", None) is not None:
        parts[SHARED_EXPERTS] = next(iter(moe.shared_experts.parameters()))
    for name, weight in parts.items():
        present.add(name)
        if weight.requires_grad:
            trained.add(name)
    lora = getattr(moe.experts, "lora", None) or {}
    for name in expert_names:
        weight_name = name.removeprefix("experts.")
        if weight_name in lora:
            adapters.append((name, int(lora[weight_name].lora_a.shape[1])))
    return present, trained, adapters


# -------------------------------------------------------------------------- FLOPs

def projection_shapes(args: Any) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection of one block, in model order."""
    return dict(family_of(args).block(args).shapes)


def matmul_params(args: Any, active: bool = True) -> int:
    """Weights that take part in a token's matrix multiplies: every projection and the
    head; of an MoE layer only what a token uses (router, top_k experts, shared ones),
    or with ``active=False`` every expert."""
    family = family_of(args)
    block, mlp = family.block(args), set(family.projections.mlp)
    attention = sum(i * o for name, (i, o) in block.shapes.items() if name not in mlp)
    dense_mlp = sum(i * o for name, (i, o) in block.shapes.items() if name in mlp)
    sparse = len(block.sparse_layers or ()) if block.moe is not None else 0
    linear = len(block.linear_layers or ())  # a Gated DeltaNet's projections instead
    total = ((args.n_layers - linear) * attention + (args.n_layers - sparse) * dense_mlp
             + linear_attention.matmul_params(args))
    if sparse:
        total += sparse * moe_active_matmul_params(block.moe, active)
    return total + args.dim * args.vocab_size


def moe_active_matmul_params(moe: Any, active: bool = True) -> int:
    """One MoE layer's matmul weights a token uses: the router, top_k experts and the
    shared experts (3 x dim x ffn per expert); ``active=False``: every expert."""
    routed = moe.top_k if active else moe.n_experts
    shared = 3 * (getattr(moe, "shared_ffn_dim", 0) or moe.n_shared_experts * moe.ffn_dim)
    return moe.dim * (moe.n_experts + routed * 3 * moe.ffn_dim + shared
                      + getattr(moe, "shared_expert_gate", False))


@dataclass
class FlopsBreakdown:
    """Training FLOPs per token, by kind. ``forward``/``backward_*`` are the weight
    matmuls (LoRA adapters included); ``attention_*`` the score and value products."""
    forward: float = 0.0
    backward_input: float = 0.0
    backward_weight: float = 0.0
    attention_forward: float = 0.0
    attention_backward: float = 0.0

    @property
    def matmul(self) -> float:
        return self.forward + self.backward_input + self.backward_weight

    @property
    def attention(self) -> float:
        return self.attention_forward + self.attention_backward

    @property
    def total(self) -> float:
        return self.matmul + self.attention

    def as_dict(self) -> dict:
        return {"forward": self.forward, "backward_input": self.backward_input,
                "backward_weight": self.backward_weight,
                "attention_forward": self.attention_forward,
                "attention_backward": self.attention_backward, "total": self.total}


def _linear(fl: FlopsBreakdown, shape: tuple[int, int], rg_in: bool, trains: bool,
            rank: int, times: float = 1) -> bool:
    """Adds y = W x (+ B A x) to ``fl``, ``times`` per token (an MoE's top_k experts);
    returns whether y requires grad."""
    n_in, n_out = shape
    fl.forward += times * (2 * n_in * n_out + 2 * rank * (n_in + n_out))
    if rg_in:  # dx = W^T dy (+ A^T d(Ax))
        fl.backward_input += times * (2 * n_in * n_out + 2 * rank * n_in)
    if trains:  # dW = dy x^T
        fl.backward_weight += times * 2 * n_in * n_out
    if rank:  # dB = dy (Ax)^T, d(Ax) = B^T dy, dA = d(Ax) x^T
        fl.backward_input += times * 2 * rank * n_out
        fl.backward_weight += times * 2 * rank * (n_in + n_out)
    return rg_in or trains or rank > 0


def _moe(fl: FlopsBreakdown, moe: Any, expert_names: tuple, tr: Trainability,
         rg_in: bool) -> bool:
    """Adds one MoE layer's active FLOPs per token to ``fl``: the router (dim x experts),
    the top_k experts each token is sent to (gate_up, then down; their biases and the
    weighting are no matmuls) and the shared experts (a gated MLP of n_shared x ffn);
    returns whether its output requires grad.

    LoRA on the stacked experts is counted as the low-rank math would cost per token,
    2 r (in + out) per expert applied (as ``_linear`` counts an adapter), not as
    ``peft.expert_lora`` runs it: folding scaling * B A into a copy of the whole stack each
    forward costs E x out x r x in per step, and makes the grouped product compute the
    full weight gradient of the folded copy (tests/unit/perf/test_flops_moe.py checks
    the difference by hand). Model FLOPs, so MFU, do not depend on that choice."""
    d, f, k = moe.dim, moe.ffn_dim, moe.top_k
    gate_up, down = expert_names
    logits = _linear(fl, (d, moe.n_experts), rg_in, tr.trains(ROUTER), 0)
    hidden = _linear(fl, (d, 2 * f), rg_in, tr.trains(gate_up), tr.rank(gate_up), times=k)
    routed = _linear(fl, (f, d), hidden, tr.trains(down), tr.rank(down), times=k)
    if shared := getattr(moe, "shared_ffn_dim", 0) or moe.n_shared_experts * f:
        trains = tr.trains(SHARED_EXPERTS)
        _linear(fl, (d, 2 * shared + getattr(moe, "shared_expert_gate", False)), rg_in,
                trains, 0)  # gate and up (and Qwen's d x 1 gate): one cost, summed
        shared_out = _linear(fl, (shared, d), rg_in or trains, trains, 0)
        routed = routed or shared_out
    return routed or logits  # (the routing weights scale the experts' outputs)


def mean_keys_per_query(seq_len: int, window: Optional[int] = None) -> float:
    """Keys a causal query sees on average: S/2, or with a sliding window W < S (each
    query sees min(position, W) keys) W - W^2 / 2S. Same continuous approximation as S/2.
    Only for the ``causal`` count: a masked SDPA still computes the full S x S products."""
    if window is None or window >= seq_len:
        return seq_len / 2
    return window - window * window / (2 * seq_len)


def flops_breakdown(args: Any, seq_len: int, trainable: Optional[Trainability] = None,
                    causal: bool = True) -> FlopsBreakdown:
    """Model FLOPs per token of one training step (forward + backward) at ``seq_len``.

    Follows autograd: a gradient is computed for an input only when something upstream of
    it takes gradients (with a frozen embedding and frozen norms, the first block's q/k/v
    need no input gradient), and for a weight only when it trains. ``causal`` halves the
    attention products (each query sees on average S/2 keys); ``causal=False`` counts the
    full S x S products, which is what torch's FlopCounterMode reports."""
    tr = trainable or Trainability.full()
    family = family_of(args)
    names, block = family.projections, family.block(args)
    fl = FlopsBreakdown()

    def linear(name: str, rg_in: bool) -> bool:
        return _linear(fl, block.shapes[name], rg_in, tr.trains(name), tr.rank(name))

    def outputs(projections: tuple[str, ...], rg_in: bool) -> list[bool]:
        """Whether each part (q, k, v; gate, up) requires grad; a fused projection is one
        matmul whose parts share the answer."""
        done = {name: linear(name, rg_in) for name in projections}
        return [done[name] for name in block.sources(projections)]

    rg = tr.embedding  # the residual stream
    sparse = set(block.sparse_layers or ()) if block.moe is not None else set()
    kinds = block.attention or ("global",) * args.n_layers
    mla = latent_attention(args)  # DeepSeek-V3's latent attention (perf/mla.py), or None
    linear_ids = set(block.linear_layers or ())
    for layer_id, kind in enumerate(kinds):
        window = block.sliding_window if kind == "sliding" else None
        keys = mean_keys_per_query(seq_len, window) if causal else seq_len
        n1 = rg or tr.norms
        if layer_id in linear_ids:
            o = linear_attention.add_flops(fl, args, seq_len, tr, n1, _linear)
        elif mla is not None:
            o = mla_flops(fl, mla, linear, tr.norms, n1, keys)
        else:
            per_product = 2 * keys * args.n_heads * args.head_dim  # Q K^T or P V, per token
            q, k, v = outputs(names.attention[:-1], n1)
            fl.attention_forward += 2 * per_product
            fl.attention_backward += per_product * ((q or k) + v + q + k)  # dP, dV, dQ, dK
            o = linear(names.attention_output, q or k or v)
        if block.parallel:  # the MLP reads the attention's input norm (GPT-J)
            n2 = n1
        else:  # the MLP's norm reads the stream after attention (Llama)
            n2 = rg or o or tr.norms
        if layer_id in sparse:
            mlp_out = _moe(fl, block.moe, names.experts, tr, n2)
        else:
            hidden = any(outputs(names.mlp_inputs, n2))
            mlp_out = linear(names.mlp_output, hidden)
        rg = rg or o or mlp_out
    _linear(fl, (args.dim, args.vocab_size), rg or tr.norms, tr.head, 0)
    return fl


def flops_per_token(args: Any, seq_len: int, trainable: Optional[Trainability] = None,
                    lora: Optional[LoraSpec] = None) -> float:
    """Training model FLOPs per token; full training unless ``trainable``/``lora`` say."""
    if trainable is None and lora is not None:
        trainable = Trainability.lora(lora)
    return flops_breakdown(args, seq_len, trainable).total


def model_flops_per_token(model: Any, seq_len: int) -> float:
    """Training FLOPs per token of a built model (or the trainer's ``TrainModel``),
    reading what trains from the model itself."""
    return flops_breakdown(model.args, seq_len, Trainability.from_model(model)).total
