"""GRPO's loss pieces (models/grpo.py) beyond what the TRL comparison covers: a step split
into micro-batches gives the whole batch's loss for each loss_type (loss_sum over the
step's units), a group of one has no advantage, and unscorable completions get none."""
from __future__ import annotations

import math

import pytest
import torch

from lmforge.models.grpo import (GRPOParams, grpo_loss, group_advantages, loss_sum,
                                 per_token_loss, units)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_micro_batches_summed_over_the_steps_units_give_the_whole_batch_loss(loss_type):
    g = torch.Generator().manual_seed(0)
    logps = -torch.rand(6, 5, generator=g)
    old, ref = logps + 0.3 * torch.randn(6, 5, generator=g), logps - 0.2
    adv = torch.randn(6, generator=g)
    mask = (torch.arange(5)[None, :] < torch.tensor([5, 2, 4, 0, 3, 1])[:, None]).float()
    p = GRPOParams(beta=0.1, loss_type=loss_type, max_completion_length=5)
    whole, _ = grpo_loss(logps, old, ref, adv, mask, p)
    parts = [slice(0, 2), slice(2, 5), slice(5, 6)]
    total_units = sum(units(mask[s], loss_type) for s in parts)
    split = sum(loss_sum(per_token_loss(logps[s], old[s], ref[s], adv[s], p)[0], mask[s], p)
                for s in parts) / total_units
    torch.testing.assert_close(split, whole)


def test_a_group_of_one_or_of_equal_rewards_has_no_advantage():
    adv, zero_std = group_advantages(torch.tensor([1.0, 2.0, 3.0]), 1, "group")
    assert adv.tolist() == [0.0, 0.0, 0.0] and zero_std.all()
    adv, zero_std = group_advantages(torch.tensor([1.0, 1.0, 0.0, 2.0]), 2, "group")
    assert adv[:2].tolist() == [0.0, 0.0] and zero_std.tolist() == [True, True, False, False]


def test_an_unscorable_completion_is_left_out_of_its_groups_baseline_and_gets_none():
    adv, _ = group_advantages(torch.tensor([1.0, math.nan, 3.0]), 3, "none")
    assert adv.tolist() == [-1.0, 0.0, 1.0]


def test_an_unknown_scale_or_loss_type_names_its_key():
    with pytest.raises(ValueError, match="rl.scale_rewards"):
        group_advantages(torch.zeros(2), 2, "std")
    with pytest.raises(ValueError, match="rl.loss_type"):
        loss_sum(torch.zeros(1, 1), torch.ones(1, 1), GRPOParams(loss_type="bnpo"))
