"""What a model family tells the rest of lmforge about itself.

A family is a folder, ``models/<family>/``, whose ``__init__.py`` exports ``FAMILY``, a
``ModelFamily``: how to build the plain model from its args, read and write Hugging Face
configs and parameter names, its tensor-parallel plan, its named sizes, and a
``BlockSpec`` per args, the description of one block that parallelism, LoRA and the
performance model read instead of branching on a family's name. ``models/registry.py``
finds the folders; nothing outside ``models/`` names a family.

Every family's model keeps the same top level (``tok_embeddings``, ``layers`` as an
``nn.ModuleDict`` keyed by layer id, ``norm``, ``output``) and its args the same shape
fields (``dim``, ``n_layers``, ``n_heads``, ``n_kv_heads``, ``head_dim``, ``vocab_size``,
``ffn_dim``, ``max_seq_len``, ``tie_embeddings``, ``family``), which is what pipeline
splitting, checkpoints and the memory model rely on.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import torch
from torch import nn

from lmforge.models.common import Projections


@dataclass(frozen=True)
class Fused:
    """A linear layer that computes several projections at once (Phi-3's ``qkv_proj``:
    q, k and v; ``gate_up_proj``: gate and up).

    Hugging Face stores the parts one after another. We store the output rows in
    ``groups`` equal groups, each holding its share of every part in order (Megatron's
    layout: for qkv a group is one kv head with its queries, for gate_up one row of
    each), so a contiguous tensor-parallel shard of whole groups holds matching slices
    of every part and the plain column split of ``models/tp.py`` applies unchanged. The
    HF mapping and the adapter export permute rows with ``rows_from_hf``."""
    parts: tuple[tuple[str, int], ...]  # (part name, output rows) in Hugging Face's order
    groups: int  # at most this many tensor-parallel ranks; every part's rows divide by it

    def __post_init__(self):
        for name, rows in self.parts:
            if rows % self.groups:
                raise ValueError(f"fused part {name}: {rows} rows do not split into "
                                 f"{self.groups} groups")

    @property
    def rows(self) -> int:
        return sum(rows for _, rows in self.parts)

    def rows_from_hf(self) -> torch.Tensor:
        """Index of HF rows in our order: ``ours = hf[index]``; ``hf = ours[argsort]``."""
        group = torch.arange(self.groups)[:, None]
        columns, start = [], 0
        for _, rows in self.parts:  # (groups, rows / groups): this part's rows per group
            n = rows // self.groups
            columns.append(start + group * n + torch.arange(n))
            start += rows
        return torch.cat(columns, dim=1).flatten()


@dataclass(frozen=True)
class BlockSpec:
    """One block as parallelism, LoRA and the performance model see it."""
    # (in_features, out_features) of each linear layer of a block, by leaf name, in model
    # order (a fused layer's out_features is the sum of its parts').
    shapes: Mapping[str, tuple[int, int]]
    fused: Mapping[str, Fused] = field(default_factory=dict)
    # "rms": weight * normalized(x).to(x's dtype); "rms_one_plus": (normalized(x) *
    # (1 + weight)).to(x's dtype), in fp32 (Gemma); "layer": LayerNorm, a weight and a bias
    norm: str = "rms"
    norms: tuple[str, ...] = ("attention_norm", "ffn_norm")  # the block's norms over dim
    # Each branch's output is normalised too before it joins the residual stream (Gemma 3:
    # the second and fourth of ``norms``).
    post_norms: bool = False
    # "swiglu": out(silu(gate) * up); "geglu": out(gelu_tanh(gate) * up);
    # "gelu": out(gelu_tanh(fc_in))
    mlp: str = "swiglu"

    @property
    def gated(self) -> bool:
        """The MLP multiplies an activated gate by an up projection."""
        return self.mlp in ("swiglu", "geglu")

    def sources(self, projections: tuple[str, ...]) -> tuple[str, ...]:
        """The projection that computes each part of ``projections``' outputs, in order:
        a fused projection once per part (qkv_proj -> q, k, v all from qkv_proj)."""
        return tuple(name for name in projections
                     for _ in (self.fused[name].parts if name in self.fused else (name,)))
    # Attention and MLP read the same normalised input in parallel (GPT-J) rather than
    # the MLP reading the attention's output (Llama).
    parallel: bool = False
    biased: tuple[str, ...] = ()  # linear layers with a bias ("output" for the head)
    rotary_features: int = 0  # features of each head that rotate
    head_norms: bool = False  # q and k pass a norm over each head (Qwen3, Gemma 3)
    # Per layer: "global" (causal) or "sliding" (causal within ``sliding_window``).
    attention: tuple[str, ...] = ()
    sliding_window: Optional[int] = None
    # A mixture of experts (``models.moe.MoEArgs``) in place of the MLP on the layers
    # ``sparse_layers`` lists; the other layers' MLP is ``shapes``' (None: dense model).
    moe: Any = None
    sparse_layers: tuple[int, ...] = ()
    # Layers whose attention is a linear-attention layer (``models.gated_deltanet``) in
    # place of the attention ``shapes`` describes (hybrid families: Qwen3.5).
    linear_layers: tuple[int, ...] = ()
    # Their projections' (in_features, out_features), by leaf name (``shapes`` holds the
    # full-attention layers'): what LoRA adapters on them are checked against.
    linear_attention_shapes: Mapping[str, tuple[int, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelFamily:
    name: str  # the folder under models/
    model_types: tuple[str, ...]  # config.json model_type values it loads
    build: Callable[[Any], nn.Module]  # args -> model, on the current default device
    args_from_dict: Callable[[dict], Any]  # dataclasses.asdict(args) -> args (meta.json)
    args_from_hf_config: Callable[[dict, str], Any]
    hf_config: Callable[..., dict]  # (args, **extra fields) -> config.json dict
    hf_names: Callable[[Any], dict[str, str]]  # our parameter name -> HF name
    projections: Projections
    block: Callable[[Any], BlockSpec]
    block_plan: Callable[[bool], dict]  # sequence_parallel -> {module name: style}
    model_plan: Callable[[bool], dict]
    presets: Mapping[str, Any]
    check_args: Callable[[Any], None]  # shapes the model cannot have -> ConfigError
    as_variant: Callable[[Any, str], Any] = lambda args, model_type: args
    # HF checkpoint keys that hold buffers rather than weights (ignored on load).
    ignored_hf_suffixes: tuple[str, ...] = ()
    # transformers' rope_scaling mapping -> the args' rope_scaling (mapping, where, the
    # model's positions), for ``model.rope_scaling``; None: the family takes no override.
    rope_scaling: Optional[Callable[[dict, str, int], Any]] = None
    # A checkpoint's tensors in the names ``hf_names`` gives and back, where the files
    # store them otherwise (the MoE families' per-expert tensors, stacked in memory):
    # (HF state dict, args, source) -> state dict; (state dict, args) -> HF state dict.
    checkpoint_in: Callable[[dict, Any, str], dict] = lambda sd, args, source: sd
    checkpoint_out: Callable[[dict, Any], dict] = lambda sd, args: sd
    # The args read from a model directory, told that directory: a family whose
    # checkpoints hold parts it does not train (Qwen3.5's vision tower) records where they
    # are, for an export to write them back.
    with_directory: Callable[[Any, Any], Any] = lambda args, root: args
    # The layout of transformers' in-memory experts (``models.moe_hf``), which peft's
    # target_parameters adapters follow (``peft.expert_lora.to_peft``).
    expert_layout: str = "fused"
    # How llama.cpp reads the family (architecture, write_hparams, tensors; see
    # models/llama/gguf.py), or why it has no GGUF form (a sentence, for the refusal).
    gguf: Any = "lmforge has no GGUF form for it"


def from_folder(model, hf, plan, presets, **family) -> ModelFamily:
    """A family from the modules every family folder holds: model.py (PROJECTIONS,
    block_spec), hf.py (args_from_hf_config, hf_config_from_args, hf_names), plan.py
    (block_plan, model_plan) and presets.py (PRESETS, check_args)."""
    return ModelFamily(
        args_from_hf_config=hf.args_from_hf_config, hf_config=hf.hf_config_from_args,
        hf_names=hf.hf_names, projections=model.PROJECTIONS, block=model.block_spec,
        block_plan=plan.block_plan, model_plan=plan.model_plan, presets=presets.PRESETS,
        check_args=presets.check_args, **family)
