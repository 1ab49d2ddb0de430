"""Low-memory full fine-tuning: bf16 weights and states with stochastic rounding track
the fp32 reference; the step fused into backward equals the ordinary step; a resumed
optimizer (its state dict loaded) continues exactly, in backward too."""
import copy

import pytest
import torch

from helpers.tiny_models import tiny_llama_args
from lmforge.config import OptimConfig
from lmforge.models.llama import build_llama, materialize
from lmforge.train.low_memory import AdamWBF16, fuse_step_into_backward, stochastic_round_to_bf16
from lmforge.train.optim import build_optimizer
from lmforge.train.step import accumulate_gradients

ARGS = tiny_llama_args(dim=64, vocab_size=97, ffn_dim=128)


def test_stochastic_rounding_is_unbiased_where_truncation_is_not():
    x = torch.full((200_000,), 1.0 + 2 ** -10)  # between two bf16 neighbours (1, 1+2^-7)
    rounded = stochastic_round_to_bf16(x, torch.Generator().manual_seed(0)).float()
    assert set(rounded.unique().tolist()) == {1.0, 1.0 + 2 ** -7}
    assert rounded.mean().item() == pytest.approx(1.0 + 2 ** -10, abs=2e-5)
    assert x.to(torch.bfloat16).float().unique().tolist() == [1.0]  # nearest: always 1
    special = torch.tensor([float("inf"), float("-inf"), 0.0, -2.5])
    assert stochastic_round_to_bf16(special).float().tolist() == [float("inf"),
                                                                  float("-inf"), 0.0, -2.5]


def _batches(n):
    g = torch.Generator().manual_seed(1)
    # A learnable pattern: each token is followed by token + 1.
    out = []
    for _ in range(n):
        start = torch.randint(0, 60, (4, 1), generator=g)
        seq = (start + torch.arange(33)) % ARGS.vocab_size
        out.append({"input_ids": seq[:, :-1], "labels": seq[:, 1:]})
    return out


def _train(model, optimizer, batches, in_backward=False):
    losses = []
    for batch in batches:
        losses.append(accumulate_gradients(model, [batch], torch.device("cpu")).item())
        if not in_backward:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return losses


def test_bf16_weights_and_states_track_the_fp32_reference():
    torch.manual_seed(0)
    reference = materialize(build_llama(ARGS), "cpu")
    low = copy.deepcopy(reference).to(torch.bfloat16)
    cfg = OptimConfig(lr=3e-3, weight_decay=0.0)
    batches = _batches(25)
    ref_losses = _train(reference, build_optimizer(reference, cfg), batches)
    low_losses = _train(low, build_optimizer(low, OptimConfig(name="adamw_bf16", lr=3e-3,
                                                              weight_decay=0.0)), batches)
    assert ref_losses[-1] < ref_losses[0] - 1.0, "the reference learns"
    for step in (12, 24):
        assert low_losses[step] == pytest.approx(ref_losses[step], rel=0.05), step
    opt_state = next(iter(build_optimizer(low, OptimConfig(name="adamw_bf16")).state.values()), None)
    assert opt_state is None  # fresh optimizer: states are created lazily, in bf16 below
    optimizer = AdamWBF16(low.parameters(), lr=1e-3)
    _train(low, optimizer, batches[:1])
    assert all(s["exp_avg"].dtype == torch.bfloat16 for s in optimizer.state.values())


@pytest.mark.parametrize("kind", ["adamw", "adamw_bf16"])
def test_step_in_backward_equals_the_ordinary_step_and_frees_gradients(kind):
    torch.manual_seed(0)
    a = materialize(build_llama(ARGS), "cpu")
    b = copy.deepcopy(a)
    batches = _batches(5)
    cfg = OptimConfig(name=kind, lr=1e-3)
    opt_a, opt_b = build_optimizer(a, cfg), build_optimizer(b, cfg)
    fuse_step_into_backward(opt_b)
    losses_a = _train(a, opt_a, batches)
    losses_b = _train(b, opt_b, batches, in_backward=True)
    assert all(p.grad is None for p in b.parameters())
    assert losses_a == pytest.approx(losses_b, rel=1e-5)
    # torch's AdamW has no randomness; the bf16-state optimizer's rounding noise is a
    # function of the parameter and its step, not of the order the parameters are stepped
    # in (backward order here, forward order there): identical weights.
    tol = dict(rtol=1e-6, atol=1e-7) if kind == "adamw" else dict(rtol=0, atol=0)
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, **tol)


def _lora_like(dtype):
    """The tiny model's weights in ``dtype``, all trained (fp32: as LoRA adapters are)."""
    torch.manual_seed(0)
    return materialize(build_llama(ARGS), "cpu").to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_adamw_bf16_resumed_from_its_state_dict_continues_exactly(dtype):
    batches = _batches(4)
    straight = _lora_like(dtype)
    optimizer = AdamWBF16(straight.parameters(), lr=1e-3, weight_decay=0.1)
    _train(straight, optimizer, batches[:2])
    resumed = copy.deepcopy(straight)
    state = copy.deepcopy(optimizer.state_dict())
    _train(straight, optimizer, batches[2:])

    reloaded = AdamWBF16(resumed.parameters(), lr=1e-3, weight_decay=0.1)
    reloaded.load_state_dict(state)
    assert all(s[k].dtype == torch.bfloat16 for s in reloaded.state.values()
               for k in ("exp_avg", "exp_avg_sq"))
    _train(resumed, reloaded, batches[2:])
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_step_in_backward_takes_the_lr_of_a_loaded_optimizers_groups():
    """Loading a state dict replaces the optimizer's group dicts; the schedule then sets
    the LR in the new ones, and the step fused into backward must use it."""
    model = _lora_like(torch.float32)
    optimizer = build_optimizer(model, OptimConfig(name="adamw_bf16", lr=1e-3))
    fuse_step_into_backward(optimizer)
    optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    before = copy.deepcopy(model)
    _train(model, optimizer, _batches(1), in_backward=True)
    for a, b in zip(before.parameters(), model.parameters()):
        assert torch.equal(a, b)
