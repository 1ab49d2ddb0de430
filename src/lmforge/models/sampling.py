"""How the decoder picks each token (``models.generate``): the settings (``Sampling``),
their check, and the draw itself, on the device, from each row's own seeded stream."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from lmforge.config.keys import MIN_TEMPERATURE


@dataclass(frozen=True)
class Sampling:
    """How each token is chosen. ``temperature`` 0: greedy (argmax). Otherwise softmax of
    logits / temperature, cut to the ``top_k`` most likely (0: all), to tokens with at
    least ``min_p`` times the likeliest's probability (0: off), and to the smallest set
    whose mass reaches ``top_p`` (1: off), in that order, then renormalised."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = Sampling()
# MIN_TEMPERATURE (config.keys, where rl.temperature's bound reads it too): the smallest
# temperature that samples. Below it the draw is the argmax's in all but name, and at the
# tiny end logits / T overflows float32 (|logit| / 1e-37 already does) and the draw is
# garbage. 0 is greedy.
# Seeds are torch.Generator seeds (64 bits); a batch's rows take seed + i, so the first
# one is kept to 63 bits and any number of rows after it still fits.
MAX_SEED = 2**63 - 1


def check_sampling(max_new_tokens: Optional[int], temperature: float, top_k: Optional[int],
                   top_p: Optional[float], names: Optional[dict[str, str]] = None,
                   min_p: Optional[float] = None) -> None:
    """Refuse settings that cannot sample: ``max_new_tokens`` > 0 (None: not checked),
    ``temperature`` 0 (greedy) or finite and >= ``MIN_TEMPERATURE``, ``top_k`` >= 0 (0 or
    None: every token), ``top_p`` in (0, 1], ``min_p`` in [0, 1]. ``names``: how the
    caller spells each parameter (its options)."""
    def bad(name: str, value, rule: str) -> ValueError:
        return ValueError(f"{(names or {}).get(name, name)}: {value} {rule}")

    if max_new_tokens is not None and max_new_tokens <= 0:
        raise bad("max_new_tokens", max_new_tokens, "must be > 0")
    if not math.isfinite(temperature) or temperature < 0:
        raise bad("temperature", temperature, "must be a finite number >= 0 (0: greedy)")
    if 0 < temperature < MIN_TEMPERATURE:
        raise bad("temperature", temperature, f"must be 0 (greedy) or >= {MIN_TEMPERATURE} "
                  f"(below it the draw is the argmax's but for rounding, and the logits "
                  f"divided by a tiny one overflow float32)")
    if top_k is not None and top_k < 0:
        raise bad("top_k", top_k, "must be >= 0 (0: every token)")
    if top_p is not None and not 0 < top_p <= 1:  # also refuses nan
        raise bad("top_p", top_p, "must be in (0, 1]")
    if min_p is not None and not 0 <= min_p <= 1:
        raise bad("min_p", min_p, "must be in [0, 1] (0: off)")


def check_seed(seed: int, name: str = "seed") -> None:
    """Refuse a seed a generator cannot take for every row (``MAX_SEED``); ``name``: how
    the caller spells it."""
    if not 0 <= seed <= MAX_SEED:
        raise ValueError(f"{name}: {seed} must be in [0, 2**63 - 1]")


# ----------------------------------------------------------------------------- sampling

def sample(logits: torch.Tensor, s: Sampling, uniforms: Optional[torch.Tensor]):
    """(tokens, log p under the sampling distribution, log p under the model), each
    (batch,), for fp32 ``logits`` (batch, vocab) and one uniform in [0, 1) per row.

    Ties: argmax, top-k, the stable sort of top-p and ``searchsorted`` all break ties by
    the lower token id, so a tie never depends on the batch. A draw can change only where
    a row's logits differ in their last bits from the same prompt's alone (another
    batch size may take another matmul kernel) *and* its uniform falls within that
    difference of a CDF boundary: about 1e-7 per token."""
    model_lp = torch.log_softmax(logits, -1)
    if s.greedy:
        tokens = logits.argmax(-1)
        return tokens, torch.zeros_like(tokens, dtype=logits.dtype), _at(model_lp, tokens)
    x = logits / s.temperature
    if s.top_k and s.top_k < x.shape[-1]:
        kth = torch.topk(x, s.top_k).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, -1)
    if s.min_p > 0:
        probs = probs.masked_fill(probs < s.min_p * probs.amax(-1, keepdim=True), 0.0)
    if s.top_p < 1:
        ranked, order = probs.sort(dim=-1, descending=True, stable=True)
        # Keep the smallest prefix whose mass reaches top_p (always the first token).
        ranked = ranked.masked_fill(ranked.cumsum(-1) - ranked > s.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, ranked)
    probs = probs / probs.sum(-1, keepdim=True)
    cdf = probs.cumsum(-1)
    tokens = torch.searchsorted(cdf, uniforms[:, None] * cdf[:, -1:], right=True)[:, 0]
    # u * total may round up to the total: take the last token that has any mass.
    tokens = torch.minimum(tokens, (probs > 0).cumsum(-1).argmax(-1))
    return tokens, _at(probs, tokens).log(), _at(model_lp, tokens)


def _at(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return t.gather(-1, index[:, None])[:, 0]


class Uniforms:
    """Each row's uniforms, from its own generator, drawn ``block`` at a time on the
    device: row b's k-th token uses the k-th number of seed b's stream, whatever else is
    in the batch."""

    def __init__(self, seeds: Sequence[int], device, block: int):
        self.gens = [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]
        self.device, self.block, self.drawn = device, block, None

    def at(self, step: int) -> torch.Tensor:
        if step % self.block == 0:
            self.drawn = torch.stack([torch.rand(self.block, generator=g, device=self.device)
                                      for g in self.gens])  # (batch, block)
        return self.drawn[:, step % self.block]
