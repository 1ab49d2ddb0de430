"""GRPO's loss equals TRL's GRPOTrainer (the ``trl`` package, 1.16) on a tiny model built
by transformers, fp32 on the CPU: the advantages, the completion mask, the loss, every
parameter's gradient and the logged metrics to 1e-5, for each loss_type, beta 0 and > 0,
num_iterations 1 and 2, each scale_rewards, with a temperature != 1 and
mask_truncated_completions.

How TRL's side is built, by TRL itself: a ``GRPOTrainer`` on the model's directory whose
``rollout_func`` hands back fixed prompt and completion token ids (some ending in the end
token, some cut at the length limit) and whose two reward functions return fixed values
(one None, one group of equal rewards); ``_generate_and_score_completions`` then computes
the completion mask, the advantages and (num_iterations 2, beta > 0) the old and reference
log-probabilities. Those two are moved off the policy's own values (otherwise the ratio is
1 and the KL 0, and neither clipping nor the KL gradient is exercised) and given alike to
both sides; ``compute_loss`` then gives TRL's loss, and its backward the gradients.
lmforge's side scores the same ids with its own model loaded from the same directory, its
advantages from the same rewards by ``rewards.weighted_sum`` and ``group_advantages``.
A rollout trained as two micro-batches (TRL's gradient accumulation) checks the trainer's
normalisation: each micro-batch's ``loss_sum`` over the step's ``units``.
"""
from __future__ import annotations

import math

import pytest
import torch

from helpers.hf_models import hf_model_dir
from lmforge.models.grpo import (GRPOParams, completion_logps, completion_mask,
                                 grpo_loss, group_advantages, loss_sum, per_token_loss,
                                 units)
from lmforge.models.hf import load_hf_model, to_hf_state_dict
from lmforge.train.rewards import weighted_sum

trl = pytest.importorskip("trl")
pytest.importorskip("datasets")

G, PROMPT, WIDTH = 3, 5, 6  # group size, prompt tokens, rl.max_completion_length
LENGTHS = (6, 2, 4, 6, 3, 1)  # each completion's tokens; 6 without an end token: cut
# two reward functions' values per completion (None: not applicable), weights 1 and 0.5;
# the second prompt's group has three equal rewards (std 0)
REWARDS_A = (1.0, 0.0, None, 0.5, 0.5, 0.5)
REWARDS_B = (0.2, None, 3.0, 0.0, 0.0, 0.0)
WEIGHTS = (1.0, 0.5)
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return hf_model_dir(tmp_path_factory.mktemp("grpo-model"), "llama", seed=3)


def _ids(vocab: int, eos: int):
    """Fixed prompts (2, each repeated G times, as TRL's sampler does) and completions."""
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, vocab - 3, (PROMPT,), generator=g).tolist() for _ in range(2)]
    completions = []
    for n in LENGTHS:
        ids = torch.randint(3, vocab - 3, (n,), generator=g).tolist()
        if n < WIDTH:
            ids[-1] = eos  # ended; the 6-token ones were cut at the limit
        completions.append(ids)
    return [prompts[i // G] for i in range(2 * G)], completions


def _reward_a(prompts, completions, **kwargs):
    return list(REWARDS_A)


def _reward_b(prompts, completions, **kwargs):
    return list(REWARDS_B)


def _trainer(model_dir, tmp_path, *, loss_type, beta, num_iterations, scale_rewards,
             accumulation=1):
    from datasets import Dataset

    args = trl.GRPOConfig(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False, logging_steps=1,
        per_device_train_batch_size=2 * G // accumulation,
        gradient_accumulation_steps=accumulation,
        num_generations=G, max_completion_length=WIDTH, temperature=TEMPERATURE,
        beta=beta, epsilon=0.2, epsilon_high=0.28, num_iterations=num_iterations,
        scale_rewards=scale_rewards, loss_type=loss_type, mask_truncated_completions=True,
        reward_weights=list(WEIGHTS), model_init_kwargs={"dtype": torch.float32,
                                                          "attn_implementation": "eager"})
    holder = {}

    def rollout(prompts, trainer):
        return {"prompt_ids": holder["prompts"], "completion_ids": holder["completions"],
                "logprobs": [[0.0] * len(c) for c in holder["completions"]]}

    trainer = trl.GRPOTrainer(model=str(model_dir), reward_funcs=[_reward_a, _reward_b],
                              args=args, train_dataset=Dataset.from_dict({"prompt": ["a", "b"]}),
                              rollout_func=rollout)
    eos = trainer.eos_token_ids[0] if hasattr(trainer, "eos_token_ids") else \
        trainer.processing_class.eos_token_id
    holder["prompts"], holder["completions"] = _ids(trainer.model.config.vocab_size, eos)
    return trainer, holder


def _off_policy(logps: torch.Tensor, seed: int, scale: float) -> torch.Tensor:
    """``logps`` moved by -+``scale`` on alternate tokens, with a little noise, so that
    every completion has ratios past both clipping bounds."""
    g = torch.Generator().manual_seed(seed)
    rows, cols = torch.meshgrid(torch.arange(logps.shape[0]), torch.arange(logps.shape[1]),
                                indexing="ij")
    sign = 1 - 2 * ((rows + cols) % 2).float()
    return logps.detach() - scale * sign + 0.05 * torch.rand(logps.shape, generator=g)


CASES = [(loss_type, beta, iters, scale)
         for loss_type in ("grpo", "dr_grpo", "dapo")
         for beta, iters, scale in ((0.0, 1, "group"), (0.04, 1, "batch"),
                                    (0.0, 2, "none"), (0.04, 2, "group"))]


@pytest.mark.parametrize("loss_type,beta,num_iterations,scale_rewards", CASES)
def test_loss_and_every_gradient_equal_trls_grpo_trainer(model_dir, tmp_path, loss_type,
                                                         beta, num_iterations,
                                                         scale_rewards):
    trainer, holder = _trainer(model_dir, tmp_path, loss_type=loss_type, beta=beta,
                               num_iterations=num_iterations, scale_rewards=scale_rewards)
    hf = trainer.model
    hf.train()
    inputs = trainer._generate_and_score_completions([{"prompt": "a"}] * (2 * G))
    if num_iterations > 1:
        inputs["old_per_token_logps"] = _off_policy(inputs["old_per_token_logps"], 1, 0.4)
    else:
        assert inputs.get("old_per_token_logps") is None  # TRL: the policy's own, detached
    if beta:
        inputs["ref_per_token_logps"] = _off_policy(inputs["ref_per_token_logps"], 2, 0.5)
    trainer.current_gradient_accumulation_steps = 1  # (set by its training loop)
    hf.zero_grad()
    their_loss = trainer.compute_loss(hf, inputs)
    their_loss.backward()

    # lmforge, on the same ids, rewards and old/reference log-probabilities
    per_reward = torch.tensor([[math.nan if v is None else v for v in col]
                               for col in (REWARDS_A, REWARDS_B)]).T
    advantages, _ = group_advantages(weighted_sum(per_reward, torch.tensor(WEIGHTS)), G,
                                     scale_rewards)
    advantages = advantages.float()  # (summed in float64; the rows hold fp32, as TRL's)
    torch.testing.assert_close(advantages, inputs["advantages"], rtol=1e-5, atol=1e-6)
    completions = inputs["completion_ids"]
    lengths = torch.tensor([len(c) for c in holder["completions"]])
    truncated = lengths == WIDTH
    mask = completion_mask(lengths, completions.shape[1], truncated, mask_truncated=True)
    torch.testing.assert_close(mask, inputs["completion_mask"].float())

    ours = load_hf_model(model_dir)
    tokens = torch.cat([inputs["prompt_ids"], completions], dim=1)
    logits = ours(tokens)[:, PROMPT - 1:-1]
    logps, entropy = completion_logps(logits, completions, TEMPERATURE)
    params = GRPOParams(beta=beta, epsilon=0.2, epsilon_high=0.28, loss_type=loss_type,
                        max_completion_length=WIDTH)
    loss, metrics = grpo_loss(logps, inputs.get("old_per_token_logps"),
                              inputs.get("ref_per_token_logps"), advantages, mask, params,
                              entropy)
    loss.backward()

    torch.testing.assert_close(loss, their_loss.detach(), rtol=1e-5, atol=1e-5)
    grads = to_hf_state_dict({n: p.grad for n, p in ours.named_parameters()}, ours.args)
    theirs = {n: p.grad for n, p in hf.named_parameters()}
    assert grads.keys() == theirs.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, theirs[name], rtol=1e-5, atol=1e-5, msg=name)
    assert any(float(g.abs().max()) > 1e-3 for g in grads.values())  # (a real gradient)
    logged = trainer._metrics["train"]
    for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                 "clip_ratio/low_min", "clip_ratio/high_max", "entropy") + (("kl",) if beta else ()):
        assert metrics[name] == pytest.approx(logged[name][-1], abs=1e-5), name
    if num_iterations > 1:  # the off-policy log-probabilities clip on both sides
        assert metrics["clip_ratio/low_mean"] > 0 and metrics["clip_ratio/high_mean"] > 0


def _rows(inputs: dict, part: slice) -> dict:
    """TRL's inputs for the completions ``part`` (its micro-batch of the rollout)."""
    n = inputs["advantages"].shape[0]
    return {k: v[part] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == n else v
            for k, v in inputs.items()}


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_micro_batches_of_a_step_give_trls_gradient_accumulation(model_dir, tmp_path,
                                                                 loss_type):
    """One rollout of 6 completions trained as 2 micro-batches of 3 (TRL:
    gradient_accumulation_steps=2, steps_per_generation=2, each micro-batch's
    compute_loss; lmforge: each micro-batch's loss_sum over the step's units): the summed
    gradients are equal, so the trainer's normalisation is TRL's for every loss_type."""
    trainer, holder = _trainer(model_dir, tmp_path, loss_type=loss_type, beta=0.04,
                               num_iterations=2, scale_rewards="group", accumulation=2)
    hf = trainer.model
    hf.train()
    inputs = trainer._generate_and_score_completions([{"prompt": "a"}] * (2 * G))
    inputs["old_per_token_logps"] = _off_policy(inputs["old_per_token_logps"], 1, 0.4)
    inputs["ref_per_token_logps"] = _off_policy(inputs["ref_per_token_logps"], 2, 0.5)
    trainer.current_gradient_accumulation_steps = 2
    hf.zero_grad()
    halves = (slice(0, G), slice(G, 2 * G))
    their_loss = sum(trainer.compute_loss(hf, _rows(inputs, h)) for h in halves)
    their_loss.backward()

    ours = load_hf_model(model_dir)
    tokens = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = inputs["completion_mask"].float()
    params = GRPOParams(beta=0.04, epsilon=0.2, epsilon_high=0.28, loss_type=loss_type,
                        max_completion_length=WIDTH)
    step_units = sum(units(mask[h], loss_type) for h in halves)
    loss = 0.0
    for h in halves:
        logits = ours(tokens[h])[:, PROMPT - 1:-1]
        logps, _ = completion_logps(logits, inputs["completion_ids"][h], TEMPERATURE)
        token_loss, _ = per_token_loss(logps, inputs["old_per_token_logps"][h],
                                       inputs["ref_per_token_logps"][h],
                                       inputs["advantages"][h], params)
        part = loss_sum(token_loss, mask[h], params) / step_units
        part.backward()
        loss = loss + part.detach()
    torch.testing.assert_close(loss, their_loss.detach(), rtol=1e-5, atol=1e-5)
    grads = to_hf_state_dict({n: p.grad for n, p in ours.named_parameters()}, ours.args)
    for name, p in hf.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-5, msg=name)
