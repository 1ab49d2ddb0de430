"""A fused linear + cross-entropy: the output layer and the loss over a few tokens at a
time, so that no (tokens x vocab) tensor outlives the chunk that made it (train.fused_loss).

With a 128k vocabulary the logits are the largest tensors of a step (Llama 3: 0.5 MiB a
token in fp32, 8 GiB for 16k tokens), and the plain loss keeps them, their fp32 copy and
their log-softmax for backward. Here each chunk's logits are made, reduced to what the
loss needs (the label's logit and the log-sum-exp) and dropped. Two forms:

- ``fused_loss_sum``, the summed cross-entropy of next-token training and SFT: its
  gradient with respect to the logits, ``softmax - onehot`` per valid token, is known in
  the forward pass, so each chunk's gradients for the hidden states, the output weight
  (and bias) are computed there, from the logits still at hand. Backward only scales them
  by the upstream gradient, a scalar. Three matmuls, as the plain loss.
- ``fused_token_logps``, the per-token log-probabilities the preference objectives and
  GRPO weight token by token: d(sum_t g_t logp_t)/d logits_t = g_t (onehot - softmax_t),
  and the weight's gradient sum_t g_t (onehot - p_t) h_t^T cannot be formed before g is
  known without keeping every p_t. So forward keeps only each token's log-sum-exp and
  backward recomputes each chunk's logits once, for the hidden states' and the weight's
  gradients at the same time. Four matmuls (the chunked checkpointed loss also does four,
  and keeps an autograd graph per chunk).

Mixed precision follows autocast as ``nn.Linear`` would under it: the matmuls in the
autocast dtype, the softmax in fp32; the weight's gradient is accumulated over chunks in
fp32. A tensor-parallel (vocab-sharded, DTensor) head is refused: its loss is
``loss_parallel``'s. No family has a final logit soft-capping (Gemma 3 refuses
``final_logit_softcapping``); ``scale`` is the 1 / temperature GRPO samples under.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from lmforge import IGNORE_INDEX

FUSED_CHUNK_TOKENS = 1024  # train.fused_loss with train.loss_chunk_tokens=0


class FusedLossError(ValueError):
    """A head the fused loss cannot apply (the message names the config key)."""


def fused_loss_sum(output: nn.Module, hidden: torch.Tensor, labels: torch.Tensor,
                   chunk_tokens: int = FUSED_CHUNK_TOKENS,
                   autocast=contextlib.nullcontext) -> torch.Tensor:
    """``token_loss_sum(output(hidden), labels)`` (fp32 scalar) with its gradients
    computed chunk by chunk in this forward pass."""
    weight, bias = _head_parameters(output)
    dtype = _compute_dtype(autocast, hidden.device, weight)
    return _FusedLossSum.apply(hidden.flatten(0, -2), weight, bias, labels.flatten(),
                               chunk_tokens, dtype)


def fused_token_logps(output: nn.Module, hidden: torch.Tensor, labels: torch.Tensor,
                      chunk_tokens: int = FUSED_CHUNK_TOKENS,
                      autocast=contextlib.nullcontext, scale: float = 1.0,
                      entropy: bool = False):
    """log p(label) at each position of ``labels``' shape (fp32, 0 where there is no
    label) under the logits ``output(hidden) * scale``; with ``entropy``, also each
    labelled position's entropy (no gradient), as ``(logps, entropy)``."""
    weight, bias = _head_parameters(output)
    dtype = _compute_dtype(autocast, hidden.device, weight)
    logps, ent = _FusedLogps.apply(hidden.flatten(0, -2), weight, bias, labels.flatten(),
                                   chunk_tokens, dtype, float(scale), entropy)
    logps = logps.view(labels.shape)
    return (logps, ent.view(labels.shape)) if entropy else logps


# ------------------------------------------------------------------ the head's tensors

def _head_parameters(output: nn.Module) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The output layer's weight and bias: a plain linear layer (tied or not)."""
    if type(output).forward is not nn.Linear.forward:  # e.g. a LoRA or quantized head
        raise FusedLossError(f"train.fused_loss: the output layer is a "
                             f"{type(output).__name__}, not a plain linear layer (set "
                             f"train.fused_loss=false)")
    if any(type(t).__name__ == "DTensor" for t in (output.weight, output.bias)):
        raise FusedLossError("train.fused_loss: a vocabulary-sharded head (parallel.tp > 1) "
                             "is not supported (set train.fused_loss=false)")
    return output.weight, output.bias


def _compute_dtype(autocast, device: torch.device, weight: torch.Tensor) -> torch.dtype:
    """The matmuls' dtype: autocast's where ``autocast()`` enables it, else the weight's."""
    with autocast():
        if torch.is_autocast_enabled(device.type):
            return torch.get_autocast_dtype(device.type)
    return weight.dtype


def _no_autocast(device: torch.device):
    return torch.autocast(device.type, enabled=False)


def _chunk_logits(h, w, b, scale: float) -> torch.Tensor:
    """(chunk, vocab) fp32 logits of one chunk, from operands in the compute dtype."""
    z = F.linear(h, w, b).float()
    return z.mul_(scale) if scale != 1.0 else z


def _label_logit(z: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return z.gather(1, labels.clamp(min=0).unsqueeze(1)).squeeze(1)


def _operands(weight, bias, dtype):
    return weight.to(dtype), None if bias is None else bias.to(dtype)


class _GradSums:
    """The chunks' gradients for the hidden states (one slice each) and, summed over the
    chunks in fp32, for the weight and bias (each only where autograd asks for it)."""

    def __init__(self, hidden, weight, bias, needs):
        self.hidden = torch.empty_like(hidden) if needs[0] else None
        self.weight = (torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
                       if needs[1] else None)
        self.bias = (torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
                     if bias is not None and needs[2] else None)

    @property
    def wanted(self) -> bool:
        return any(g is not None for g in (self.hidden, self.weight, self.bias))

    def add(self, start: int, grad_z: torch.Tensor, h: torch.Tensor, w: torch.Tensor):
        """``grad_z``: (chunk, vocab) fp32 gradient of the chunk's logits."""
        gz = grad_z.to(w.dtype)
        if self.hidden is not None:
            self.hidden[start:start + h.shape[0]] = gz @ w  # (chunk, dim)
        if self.weight is not None:
            self.weight.add_(gz.t() @ h)  # (vocab, dim)
        if self.bias is not None:
            self.bias.add_(grad_z.sum(0))

    def result(self, weight, bias):
        return (self.hidden,
                None if self.weight is None else self.weight.to(weight.dtype),
                None if self.bias is None else self.bias.to(bias.dtype))


class _FusedLossSum(torch.autograd.Function):
    """Sum of -log softmax(h W^T + b)[label] over labelled tokens; the gradients are
    made in forward, where d loss / d logits = softmax - onehot is at hand."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk_tokens, dtype):
        grads = _GradSums(hidden, weight, bias, ctx.needs_input_grad)
        total = hidden.new_zeros((), dtype=torch.float32)
        with _no_autocast(hidden.device):
            w, b = _operands(weight, bias, dtype)
            for start in range(0, hidden.shape[0], chunk_tokens):
                end = start + chunk_tokens
                h, y = hidden[start:end].to(dtype), labels[start:end]
                z = _chunk_logits(h, w, b, 1.0)
                lse = torch.logsumexp(z, dim=1)
                valid = (y != IGNORE_INDEX).float()
                total += ((lse - _label_logit(z, y)) * valid).sum()
                if grads.wanted:  # z becomes (softmax - onehot) on labelled rows, in place
                    z.sub_(lse.unsqueeze(1)).exp_()
                    z.scatter_add_(1, y.clamp(min=0).unsqueeze(1), -valid.unsqueeze(1))
                    grads.add(start, z.mul_(valid.unsqueeze(1)), h, w)
                del z
        ctx.grads = grads.result(weight, bias)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        if ctx.grads is None:
            raise RuntimeError("the fused loss's gradients were used by an earlier "
                               "backward (retain_graph is not supported)")
        grad_hidden, grad_weight, grad_bias = ctx.grads
        ctx.grads = None
        # (scaled in place: these buffers are this backward's alone)
        scaled = [None if g is None else g.mul_(grad_total.to(g.dtype))
                  for g in (grad_hidden, grad_weight, grad_bias)]
        return scaled[0], scaled[1], scaled[2], None, None, None


class _FusedLogps(torch.autograd.Function):
    """Per-token log softmax(scale (h W^T + b))[label]; forward keeps each token's
    log-sum-exp, backward recomputes each chunk's logits for every gradient at once."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk_tokens, dtype, scale, entropy):
        n = hidden.shape[0]
        logps = hidden.new_zeros(n, dtype=torch.float32)
        lses = hidden.new_zeros(n, dtype=torch.float32)
        ent = hidden.new_zeros(n if entropy else 0, dtype=torch.float32)
        with _no_autocast(hidden.device):
            w, b = _operands(weight, bias, dtype)
            for start in range(0, n, chunk_tokens):
                end = start + chunk_tokens
                h, y = hidden[start:end].to(dtype), labels[start:end]
                z = _chunk_logits(h, w, b, scale)
                lse = torch.logsumexp(z, dim=1)
                valid = (y != IGNORE_INDEX).float()
                logps[start:end] = (_label_logit(z, y) - lse) * valid
                lses[start:end] = lse
                if entropy:  # H = lse - sum(p z)
                    p = (z - lse.unsqueeze(1)).exp_()
                    ent[start:end] = (lse - (p * z).sum(1)) * valid
                del z
        ctx.save_for_backward(hidden, weight, bias, labels, lses)
        ctx.chunk_tokens, ctx.dtype, ctx.scale = chunk_tokens, dtype, scale
        ctx.mark_non_differentiable(ent)
        return logps, ent

    @staticmethod
    def backward(ctx, grad_logps, _grad_entropy):
        hidden, weight, bias, labels, lses = ctx.saved_tensors
        grads = _GradSums(hidden, weight, bias, ctx.needs_input_grad)
        if not grads.wanted:
            return None, None, None, None, None, None, None, None
        chunk, scale = ctx.chunk_tokens, ctx.scale
        with _no_autocast(hidden.device):
            w, b = _operands(weight, bias, ctx.dtype)
            for start in range(0, hidden.shape[0], chunk):
                end = start + chunk
                h, y = hidden[start:end].to(ctx.dtype), labels[start:end]
                # d logp / d z = scale (onehot - softmax), weighted by each token's grad
                g = grad_logps[start:end].float() * (y != IGNORE_INDEX).float()
                z = _chunk_logits(h, w, b, scale).sub_(lses[start:end].unsqueeze(1)).exp_()
                z.scatter_add_(1, y.clamp(min=0).unsqueeze(1), -torch.ones_like(z[:, :1]))
                z.mul_((-scale * g).unsqueeze(1))
                grads.add(start, z, h, w)
                del z
        grad_hidden, grad_weight, grad_bias = grads.result(weight, bias)
        if grad_hidden is not None:
            grad_hidden = grad_hidden.to(hidden.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None
