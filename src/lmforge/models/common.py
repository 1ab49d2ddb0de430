"""What every family's model shares: the names of a block's projections, the KV cache of
incremental decoding, the gated MLP, the stack of blocks (which applies
``model.attention`` to a packed batch's ``DocumentMask``), and allocating a meta-built
model (``materialize``)."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.models.attention import DocumentMask


@dataclass(frozen=True)
class Projections:
    """A block's linear layers by their leaf names (ours, which are also Hugging Face's,
    so peft's ``target_modules`` are the same words), in model order."""
    attention: tuple[str, ...]  # q, k, v, then the attention output
    mlp: tuple[str, ...]  # the MLP's input projection(s), then its output
    # Other names users write for a projection (Meta's wq, w1, ...; short q, k, v, ...).
    aliases: Mapping[str, str] = field(default_factory=dict)
    # What LoRA adapts when ``lora.targets`` is not set: peft's default for the family.
    lora_default: tuple[str, ...] = ()
    # A part's usual name -> the fused projection that computes it (Phi-3's q_proj ->
    # qkv_proj): not a layer of its own, so a target naming it is refused with the hint.
    fused_parts: Mapping[str, str] = field(default_factory=dict)
    # A mixture of experts' stacked weights that LoRA adapts (``peft.expert_lora``),
    # spelled ``experts.<parameter>``, and the one each MLP projection name stands for
    # there: a target naming the MLP's projection adapts the experts' too, so "down_proj"
    # never silently leaves the experts out.
    experts: tuple[str, ...] = ()
    experts_for: Mapping[str, str] = field(default_factory=dict)
    # A hybrid family's linear-attention layers' projections (Gated DeltaNet's), in model
    # order: LoRA reaches them as peft does, but they are no part of ``attention``, whose
    # names the tensor-parallel plan and the performance model read as q, k, v, output.
    linear_attention: tuple[str, ...] = ()
    # Linear layers the checkpoint files, and so transformers' model and peft, hold fused
    # where we keep the parts apart (Qwen3-Next's in_proj_qkvz: our in_proj_qkv and
    # in_proj_z), each with its parts in the fused rows' order: a target naming one means
    # its parts, and the parts' adapters cross to peft as one (``peft.adapters``).
    fused_in_files: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def all(self) -> tuple[str, ...]:
        return self.attention + self.linear_attention + self.mlp

    @property
    def adaptable(self) -> tuple[str, ...]:
        """Everything LoRA may adapt: the linear layers, then the experts' weights."""
        return self.all + self.experts

    @property
    def attention_output(self) -> str:
        return self.attention[-1]

    @property
    def mlp_inputs(self) -> tuple[str, ...]:
        return self.mlp[:-1]

    @property
    def mlp_output(self) -> str:
        """"" when the family has no dense MLP (gpt-oss: experts in every layer)."""
        return self.mlp[-1] if self.mlp else ""


@dataclass
class KVCache:
    """Keys and values of past positions for incremental decoding, one per layer. Every
    row writes at the same column (the decoder left-pads its rows): at ``length``, which
    the cache advances, or, for the compiled decode step, at ``columns``: a tensor the
    decoder sets, so that one compiled graph serves every position, and the whole buffer
    is returned (a static shape; ``DecodeMask`` hides the columns not yet written)."""
    k: torch.Tensor  # (batch, kv_heads, max_len, head_dim)
    v: torch.Tensor  # (batch, kv_heads, max_len, v_head_dim): MLA's differs from the keys'
    length: int = 0
    columns: Optional[torch.Tensor] = None  # (seq,) long: the static cache's write columns

    @classmethod
    def empty(cls, args, batch: int, max_len: int, device, dtype) -> "KVCache":
        shape = (batch, args.n_kv_heads, max_len, args.head_dim)
        v_shape = (*shape[:3], _v_head_dim(args))
        return cls(torch.zeros(shape, device=device, dtype=dtype),
                   torch.zeros(v_shape, device=device, dtype=dtype))

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if k.shape[1] != self.k.shape[1]:  # (once, at the first write)
            # Tensor parallelism: this rank computes only its share of the kv heads.
            self.k = self.k.new_zeros(self.k.shape[0], k.shape[1], *self.k.shape[2:])
            self.v = self.v.new_zeros(self.v.shape[0], v.shape[1], *self.v.shape[2:])
        if self.columns is not None:
            self.k.index_copy_(2, self.columns, k.to(self.k.dtype))
            self.v.index_copy_(2, self.columns, v.to(self.v.dtype))
            return self.k, self.v
        end = self.length + k.shape[2]
        if end > self.k.shape[2]:
            raise ValueError(f"KV cache full: {end} positions > {self.k.shape[2]}")
        self.k[:, :, self.length:end] = k
        self.v[:, :, self.length:end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]

    def buffers(self) -> tuple[torch.Tensor, ...]:
        """What a compiled decode step reads and writes in place (static addresses)."""
        return self.k, self.v

    @staticmethod
    def bytes_per_token(args, dtype: torch.dtype) -> int:
        """One row's keys and values of one position, over every layer."""
        return (args.n_layers * args.n_kv_heads * (args.head_dim + _v_head_dim(args))
                * dtype.itemsize)


def _v_head_dim(args) -> int:
    """The values' head dim: the keys' unless the args say otherwise (MLA's ``v_head_dim``)."""
    return getattr(args, "v_head_dim", None) or args.head_dim


# A gated MLP's activation by name: SwiGLU's (Llama, Mistral, Qwen, Phi-3) and GeGLU's
# tanh-approximated GELU (Gemma).
GATE_ACTIVATIONS = {"silu": F.silu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh")}


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), bias-free: SwiGLU with silu, GeGLU with gelu_tanh."""

    def __init__(self, dim: int, ffn_dim: int, activation: str):
        super().__init__()
        self.activation = activation
        self.gate_proj = nn.Linear(dim, ffn_dim, bias=False)
        self.up_proj = nn.Linear(dim, ffn_dim, bias=False)
        self.down_proj = nn.Linear(ffn_dim, dim, bias=False)

    def forward(self, x):
        gate = GATE_ACTIVATIONS[self.activation](self.gate_proj(x))
        return self.down_proj(gate * self.up_proj(x))

    def reset_parameters(self, std: float, out_std: float) -> None:
        """Truncated N(0, std) inputs; the output, which adds to the residual, ``out_std``."""
        for proj, s in ((self.gate_proj, std), (self.up_proj, std), (self.down_proj, out_std)):
            nn.init.trunc_normal_(proj.weight, std=s, a=-3 * s, b=3 * s)


class PreNormBlock(nn.Module):
    """h = x + attention(attention_norm(x)); h + feed_forward(ffn_norm(h)): Llama's block,
    and the mixture-of-experts families' (Qwen3-MoE, Mixtral, gpt-oss, DeepSeek-V3),
    whose MoE feed-forward also returns its ``Routing`` (kept by the MoE for the trainer,
    so only the output joins the residual). A family builds the four parts."""

    def __init__(self, layer_id: int, attention_norm: nn.Module, attention: nn.Module,
                 ffn_norm: nn.Module, feed_forward: nn.Module):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm, self.attention = attention_norm, attention
        self.ffn_norm, self.feed_forward = ffn_norm, feed_forward

    def forward(self, x, positions=None, mask=None, cache=None):
        h = x + self.attention(self.attention_norm(x), positions, mask, cache)
        out = self.feed_forward(self.ffn_norm(h))
        return h + (out[0] if isinstance(out, tuple) else out)  # (batch, seq, dim)

    def reset_parameters(self, std: float, n_layers: int) -> None:
        # Residual-branch outputs shrink with depth so the residual stream keeps unit scale.
        out_std = std / math.sqrt(2 * n_layers)
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.reset_parameters(std, out_std)
        self.feed_forward.reset_parameters(std, out_std)


class DecoderStack(nn.Module):
    """The top level every family's model shares (``models/registry.py``): token
    embeddings, the blocks in ``layers`` (an ``nn.ModuleDict`` keyed by layer id), a final
    norm and the output head. What is particular to a family is its block; a pipeline
    stage sets the parts it does not hold to None, and ``forward`` skips them. The last
    stage of a tied model keeps the embedding, whose weight is its head's, and ``forward``
    applies it to token ids only, never to the hidden states a later stage receives."""

    def __init__(self, args, block: Callable[[object, int], nn.Module], norm: nn.Module,
                 output_bias: bool):
        """``block(args, layer_id)`` builds one of the family's blocks; ``norm`` is the
        final norm."""
        super().__init__()
        self.args = args
        self.attention = "sdpa"  # model.attention: how a mask is applied (models/attention.py)
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): block(args, i) for i in range(args.n_layers)})
        self.norm = norm
        self.output = nn.Linear(args.dim, args.vocab_size, bias=output_bias)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor, positions: Optional[torch.Tensor] = None,
                mask: Optional[torch.Tensor] = None, caches: Optional[list[KVCache]] = None,
                head: bool = True):
        """tokens: (batch, seq) ids, or hidden states (batch, seq, dim) on a later pipeline
        stage. positions: (batch, seq), default 0..seq-1 after any cached ones. mask: a
        packed batch's ``DocumentMask``, or boolean (batch, 1, seq, keys), True = may
        attend; None = causal. head=False stops
        after the final norm, for a loss that applies ``output`` a chunk at a time."""
        embeds = self.tok_embeddings is not None and not tokens.is_floating_point()
        h = self.tok_embeddings(tokens) if embeds else tokens
        if isinstance(mask, DocumentMask):
            mask = mask.using(self.attention)
        elif mask is None and self.attention != "sdpa" and not caches:
            mask = DocumentMask(None, self.attention)  # (a sliding window's, under flex)
        for i, layer in enumerate(self.layers.values()):
            h = layer(h, positions, mask, caches[i] if caches else None)  # (batch, seq, dim)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is None or not head:
            return h
        return self.output(h)  # (batch, seq, vocab)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Random initialisation, called after ``to_empty`` on the target device: the
        embedding N(0, std), each block by its own ``reset_parameters(std, n_layers)``,
        the norm to identity, an untied head truncated N(0, std) and its bias to zero.
        (Llama's differs on a first pipeline stage, and overrides it.)"""
        std = self.args.init_std
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight, std=std)
        for layer in self.layers.values():
            layer.reset_parameters(std, self.args.n_layers)
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None:
            if not self.args.tie_embeddings:
                nn.init.trunc_normal_(self.output.weight, std=std, a=-3 * std, b=3 * std)
            if self.output.bias is not None:
                nn.init.zeros_(self.output.bias)


def new_caches(model: nn.Module, batch: int, max_len: int) -> list:
    """An empty cache per layer of ``model``, in its parameters' device and dtype: a
    ``KVCache``, or what the layer's attention makes itself (``new_cache``: a linear
    attention's fixed-size state)."""
    p = next(model.parameters())
    caches = []
    for layer in model.layers.values():
        make = getattr(getattr(layer, "attention", None), "new_cache", None)
        caches.append(make(batch, max_len, p.device, p.dtype) if make is not None
                      else KVCache.empty(model.args, batch, max_len, p.device, p.dtype))
    return caches


def materialize(model: nn.Module, device: str | torch.device, init: bool = True) -> nn.Module:
    """Allocate a meta-built model on ``device``; random-init unless weights come next."""
    tied = model.args.tie_embeddings and model.output is not None
    model.to_empty(device=device)
    if tied:  # to_empty allocates each reference separately, which unties them
        model.output.weight = model.tok_embeddings.weight
    if init:
        model.init_weights()
    return model


def count_parameters(model: nn.Module) -> int:
    """Distinct parameters (a tied embedding counts once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
