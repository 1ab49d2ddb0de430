"""A model scored on preference pairs (``lmforge eval --objective``): the mean per-pair
loss of DPO, IPO, SimPO or ORPO and TRL's metrics (rewards/chosen, rewards/margins,
rewards/accuracies, ...), against a reference model or, for an adapted model, the model
with its adapters off. The formulas are ``models.preference``'s, as the trainer's."""
from __future__ import annotations

import contextlib
from typing import Iterable, Optional

import torch
from torch import nn

from lmforge.models.preference import (NEEDS_REFERENCE, PreferenceParams, preference_loss,
                                       sequence_logps)
from lmforge.peft.lora import adapters_disabled, lora_layers


@torch.no_grad()
def evaluate_pairs(model: nn.Module, batches: Iterable[dict], device: torch.device,
                   objective: str, params: PreferenceParams,
                   reference: Optional[nn.Module] = None) -> dict:
    """{"pairs", "loss", metric: mean over the pairs}. DPO and IPO compare with
    ``reference``, else with ``model``'s adapters switched off (one must be there)."""
    needs = objective in NEEDS_REFERENCE
    if needs and reference is None and not lora_layers(model):
        raise ValueError(f"--reference: {objective} compares with a reference model: give "
                         f"one, or an --adapter whose base model is the reference")
    model.eval()
    sums: dict = {}
    pairs = 0
    for batch in batches:
        policy = sequence_logps(model, batch, device)
        ref = None
        if needs:
            off = adapters_disabled(model) if reference is None else contextlib.nullcontext()
            with off:
                ref = sequence_logps(reference if reference is not None else model, batch,
                                     device)
        loss, metrics = preference_loss(objective, policy, ref, params)
        for name, values in {"loss": loss, **metrics}.items():
            sums[name] = sums.get(name, 0.0) + float(values.double().sum())
        pairs += int(batch["n_pairs"])
    if not pairs:
        raise ValueError("the preference data has no pairs to score")
    return {"pairs": pairs, **{name: total / pairs for name, total in sums.items()}}
