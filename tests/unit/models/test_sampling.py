"""models/sampling.py: the settings' checks (the temperature floor, the seed range) and
that a temperature at the floor still samples finite values from large logits."""
from __future__ import annotations

import pytest
import torch

from lmforge.models.sampling import (MAX_SEED, MIN_TEMPERATURE, Sampling, check_sampling,
                                     check_seed, sample)


@pytest.mark.parametrize("temperature", [1e-45, 1e-38, MIN_TEMPERATURE / 2])
def test_a_temperature_under_the_floor_is_refused_naming_the_option(temperature):
    with pytest.raises(ValueError, match=r"^--temperature: .* must be 0 \(greedy\) or >= "):
        check_sampling(8, temperature, None, None, {"temperature": "--temperature"})


def test_a_temperature_at_the_floor_samples_finite_values_from_large_logits():
    check_sampling(8, MIN_TEMPERATURE, None, None)
    check_sampling(8, 0.0, None, None)  # greedy
    logits = torch.tensor([[3e4, -3e4, 2.99e4, 0.0]])
    tokens, sampling_lp, model_lp = sample(logits, Sampling(MIN_TEMPERATURE),
                                           torch.tensor([0.5]))
    assert tokens.tolist() == [0]
    assert torch.isfinite(sampling_lp).all() and torch.isfinite(model_lp).all()


@pytest.mark.parametrize("seed", [-1, MAX_SEED + 1, 2**64])
def test_a_seed_out_of_range_is_refused_naming_the_option(seed):
    with pytest.raises(ValueError, match=rf"^--seed: {seed} must be in \[0, 2\*\*63 - 1\]$"):
        check_seed(seed, "--seed")


def test_the_last_seed_leaves_room_for_a_row_seed_past_it():
    check_seed(MAX_SEED)
    torch.Generator().manual_seed(MAX_SEED + 10_000)  # row i samples with seed + i
