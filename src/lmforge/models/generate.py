"""Text generation with a KV cache: greedy, or sampled with temperature / top-k / top-p."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from lmforge.models.common import new_caches


@torch.no_grad()
def generate(model: nn.Module, prompt_ids: list[int], max_new_tokens: int, greedy: bool = True,
             temperature: float = 1.0, top_k: Optional[int] = None,
             top_p: Optional[float] = None, stop_ids: tuple[int, ...] = (),
             generator: Optional[torch.Generator] = None) -> list[int]:
    """Returns the new tokens only; stops early on any of ``stop_ids``."""
    check_sampling(None, temperature, top_k, top_p)  # 0 new tokens: an empty answer
    if not prompt_ids:
        raise ValueError("generate: the prompt is empty (give at least one token)")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    max_len = min(len(prompt_ids) + max_new_tokens, model.args.max_seq_len)
    caches = new_caches(model, 1, max_len)
    tokens = torch.tensor([prompt_ids], device=device)  # (1, prompt)
    new: list[int] = []
    for _ in range(max_len - len(prompt_ids)):
        logits = model(tokens, caches=caches)[:, -1].float()  # (1, vocab)
        next_id = _pick(logits, greedy, temperature, top_k, top_p, generator)
        new.append(next_id)
        if next_id in stop_ids:
            break
        tokens = torch.tensor([[next_id]], device=device)  # (1, 1): cache holds the past
    model.train(was_training)
    return new


def check_sampling(max_new_tokens: Optional[int], temperature: float, top_k: Optional[int],
                   top_p: Optional[float], names: Optional[dict[str, str]] = None) -> None:
    """Refuse settings that cannot sample: ``max_new_tokens`` > 0 (None: not checked),
    ``temperature`` finite and >= 0 (0: greedy), ``top_k`` >= 0 (0 or None: every token),
    ``top_p`` in (0, 1]. ``names``: how the caller spells each parameter (its options)."""
    def bad(name: str, value, rule: str) -> ValueError:
        return ValueError(f"{(names or {}).get(name, name)}: {value} {rule}")

    if max_new_tokens is not None and max_new_tokens <= 0:
        raise bad("max_new_tokens", max_new_tokens, "must be > 0")
    if not math.isfinite(temperature) or temperature < 0:
        raise bad("temperature", temperature, "must be a finite number >= 0 (0: greedy)")
    if top_k is not None and top_k < 0:
        raise bad("top_k", top_k, "must be >= 0 (0: every token)")
    if top_p is not None and not 0 < top_p <= 1:  # also refuses nan
        raise bad("top_p", top_p, "must be in (0, 1]")


def _pick(logits: torch.Tensor, greedy: bool, temperature: float, top_k: Optional[int],
          top_p: Optional[float], generator: Optional[torch.Generator]) -> int:
    if greedy or temperature <= 0:
        return int(logits.argmax(-1))
    logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, -1)
    if top_p is not None and top_p < 1.0:
        sorted_probs, order = probs.sort(-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always the first token).
        drop = sorted_probs.cumsum(-1) - sorted_probs > top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    choice = torch.multinomial(probs.cpu(), 1, generator=generator)
    return int(choice)
