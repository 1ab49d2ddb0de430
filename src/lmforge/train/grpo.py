"""GRPO as the trainer's step calls it (``train.objectives``): ``prepare`` turns a step's
micro-batches of prompts into micro-batches of completions (the rollout), then the step
runs like any other objective's, ``loss_sum`` per micro-batch over the step's ``units``.

The rollout, per micro-batch of prompts:
1. **generate**: each prompt ``rl.num_generations`` times through the one batched decoder
   (``models.generate``), the policy as it trains, in eval mode (no LoRA dropout); each
   completion's sampling generator seeded from (train.seed, step, the prompt's stream
   index, the sample's number), so a resumed run samples what an uninterrupted one does;
2. **score**: the rewards (``train.rewards``) on the decoded completions with their
   records' fields, the weighted sum, the group-normalised advantages (``models.grpo``);
3. the rows ``prompt + completion`` (right-padded), labels on the completion tokens, and
   with ``rl.beta > 0`` the reference model's log-probabilities of them: the model with
   its adapters off (LoRA) or a frozen copy of the starting weights.

The step then trains on that rollout once (``rl.num_iterations`` 1: the rollout's policy is
the policy, the ratio is 1 in value). The metrics carry TRL's names, with the seconds
spent generating, scoring and training. One process for now (``config/rl.py``).
"""
from __future__ import annotations

import contextlib
import hashlib
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from lmforge import IGNORE_INDEX
from lmforge.models.generate import generate
from lmforge.models.grpo import (GRPOParams, group_advantages, loss_sum, per_token_loss,
                                 units)
from lmforge.models.loss import fused_head, fused_label_logps, model_inputs
from lmforge.models.sampling import GREEDY, Sampling
from lmforge.peft.lora import adapters_disabled
from lmforge.train.rewards import Reward, score, weighted_sum

# the per-token metrics loss_sum sums (each over completion tokens)
TOKEN_METRICS = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean",
                 "clip_ratio/region_mean")


@dataclass(eq=False)
class GRPO:
    """The objective; ``reference``: adapters_off | model | none (rl.beta 0)."""
    params: GRPOParams
    rewards: list[Reward]
    num_generations: int
    sampling: Sampling
    scale_rewards: str = "group"
    seed: int = 0
    reference: str = "none"
    reference_model: Optional[nn.Module] = field(default=None, repr=False)
    name = "grpo"
    # step units / step completion tokens: loss_sum's token sums become token means
    # when mean_stats divides them by the step's units
    _scale: float = field(default=1.0, init=False, repr=False)

    @property
    def unit(self) -> str:  # (what metrics.jsonl names the count)
        return "completion_tokens" if self.params.loss_type == "dapo" else "completions"

    def count(self, batch: dict) -> int:
        return int(units(batch["completion_mask"], self.params.loss_type))

    # ------------------------------------------------------------------ the rollout
    def prepare(self, tm, micro_batches: list[dict], step: int, device: torch.device,
                autocast=contextlib.nullcontext) -> tuple[list[dict], dict]:
        """The step's micro-batches of completions, and the rollout's metrics."""
        model = tm.parts[0]
        times = {"generate": 0.0, "score": 0.0}
        out, per_reward, rewards, lengths, clipped, zero_std = [], [], [], [], [], []
        for prompts in micro_batches:
            t0 = time.perf_counter()
            rows = self._generate(model, prompts, step)
            t1 = time.perf_counter()
            batch, scored = self._score(prompts, rows)
            times["generate"] += t1 - t0
            times["score"] += time.perf_counter() - t1
            if self.params.beta:
                batch["ref_logps"] = self._reference_logps(model, batch, device, autocast)
            out.append(batch)
            per_reward.append(scored["per_reward"])
            rewards.append(scored["rewards"])
            zero_std.append(scored["zero_std"])
            lengths += [len(c.ids) for c in rows]
            clipped += [c.finish_reason == "length" for c in rows]
        tokens = sum(float(b["completion_mask"].sum()) for b in out)
        self._scale = sum(self.count(b) for b in out) / max(tokens, 1.0)
        return out, self._rollout_metrics(torch.cat(per_reward), torch.cat(rewards),
                                          torch.cat(zero_std), lengths, clipped, times)

    def _generate(self, model: nn.Module, prompts: dict, step: int,
                  sampling: Optional[Sampling] = None, per_prompt: Optional[int] = None):
        batch = prompts["prompts"]
        g = self.num_generations if per_prompt is None else per_prompt
        ids = [p for p in batch.ids for _ in range(g)]
        seeds = [completion_seed(self.seed, step, int(s), j)
                 for s in prompts["sample_ids"].tolist() for j in range(g)]
        was_training = model.training
        model.eval()  # (LoRA dropout off: the rollout samples the policy itself)
        try:
            return generate(model, ids, self.params.max_completion_length,
                            sampling or self.sampling, stop_ids=batch.stop_ids, seeds=seeds)
        finally:
            model.train(was_training)

    def _score(self, prompts: dict, rows, per_prompt: Optional[int] = None
               ) -> tuple[dict, dict]:
        batch = prompts["prompts"]
        g = self.num_generations if per_prompt is None else per_prompt
        records = [r for r in batch.records for _ in range(g)]
        # as TRL: a chat prompt's completion is an assistant message, a text's is text
        texts = [batch.tokenizer.decode(c.ids) for c in rows]
        texts = [[{"role": "assistant", "content": t}] if isinstance(r["prompt"], list)
                 else t for t, r in zip(texts, records)]
        fields = {k: [r.get(k) for r in records]
                  for k in dict.fromkeys(k for r in records for k in r if k != "prompt")}
        per_reward = score(self.rewards, [r["prompt"] for r in records], texts,
                           [c.ids for c in rows], fields)
        weights = torch.tensor([r.weight for r in self.rewards])
        rewards = weighted_sum(per_reward, weights)
        advantages, zero_std = group_advantages(rewards, g, self.scale_rewards)
        prompt_ids = [p for p in batch.ids for _ in range(g)]
        return (completion_rows(prompt_ids, [c.ids for c in rows], advantages,
                                prompts["sample_ids"].repeat_interleave(g)),
                {"per_reward": per_reward, "rewards": rewards, "zero_std": zero_std})

    @torch.no_grad()
    def _reference_logps(self, model, batch, device, autocast) -> torch.Tensor:
        if self.reference == "adapters_off":
            with adapters_disabled(model):
                return self._logps(model, batch, device, autocast)[0]
        return self._logps(self.reference_model, batch, device, autocast)[0]

    def _logps(self, model, batch, device, autocast):
        if fused_head(model):  # train.fused_loss: no (tokens x vocab) logits kept
            return fused_label_logps(model, batch, device, autocast,
                                     self.sampling.temperature or 1.0)
        with autocast():
            logits = model(**model_inputs(batch, device))
        return label_logps(logits, batch["labels"].to(device), self.sampling.temperature
                           or 1.0)

    def _rollout_metrics(self, per_reward, rewards, zero_std, lengths, clipped,
                         times) -> dict:
        """TRL's names: ``reward``, ``reward_std``, ``rewards/<name>/mean`` and ``/std``,
        ``frac_reward_zero_std``, ``completions/*``; and the seconds generating and
        scoring (``time/generate_s``, ``time/score_s``)."""
        lengths_t = torch.tensor(lengths, dtype=torch.float64)
        out = {"reward": _nanmean(rewards), "reward_std": _nanstd(rewards)}
        for i, reward in enumerate(self.rewards):
            out[f"rewards/{reward.name}/mean"] = _nanmean(per_reward[:, i])
            out[f"rewards/{reward.name}/std"] = _nanstd(per_reward[:, i])
        out.update({"frac_reward_zero_std": float(zero_std.float().mean()),
                    "completions/mean_length": float(lengths_t.mean()),
                    "completions/min_length": float(lengths_t.min()),
                    "completions/max_length": float(lengths_t.max()),
                    "completions/clipped_ratio": sum(clipped) / max(len(clipped), 1),
                    "time/generate_s": times["generate"], "time/score_s": times["score"]})
        return out

    # ------------------------------------------------------------------ the loss
    def loss_sum(self, model: nn.Module, batch: dict, device: torch.device,
                 autocast=contextlib.nullcontext, loss_chunk_tokens: int = 0,
                 stats: Optional[dict] = None) -> torch.Tensor:
        logps, entropy = self._logps(model, batch, device, autocast)
        mask = batch["completion_mask"].to(device)
        ref = batch.get("ref_logps")
        token_loss, parts = per_token_loss(logps, None, None if ref is None else ref.to(device),
                                           batch["advantages"].to(device), self.params)
        if stats is not None:
            self._add_token_stats(stats, parts, entropy, mask)
        return loss_sum(token_loss, mask, self.params)

    def _add_token_stats(self, stats: dict, parts: dict, entropy, mask) -> None:
        """Sums that ``mean_stats`` (which divides by the step's units) turns into means
        over the step's completion tokens: each scaled by units / tokens."""
        ratio, adv = parts["ratio"], parts["advantages"]
        low = ((ratio < 1 - self.params.epsilon) & (adv < 0)).double()
        high = ((ratio > 1 + self.params.eps_high) & (adv > 0)).double()
        values = {"entropy": entropy.detach().double(), "clip_ratio/low_mean": low,
                  "clip_ratio/high_mean": high, "clip_ratio/region_mean": torch.maximum(low, high)}
        if "kl" in parts:
            values["kl"] = parts["kl"].double()
        for name, v in values.items():
            total = (v * mask).sum() * self._scale
            stats[name] = stats[name] + total if name in stats else total

    def stage_loss_sum(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        raise ValueError("parallel.pp: GRPO does not run in a pipeline")

    # ------------------------------------------------------------------ held out
    @torch.no_grad()
    def held_out(self, tm, batches, device: torch.device, autocast) -> dict[str, float]:
        """One greedy completion per held-out prompt: ``eval_reward`` (the mean weighted
        reward) and ``eval_rewards/<name>/mean``, ``eval_prompts``."""
        model = tm.parts[0]
        per_reward, rewards = [], []
        for prompts in batches:
            rows = self._generate(model, prompts, 0, GREEDY, per_prompt=1)
            _, scored = self._score(prompts, rows, per_prompt=1)
            per_reward.append(scored["per_reward"])
            rewards.append(scored["rewards"])
        if not rewards:
            raise ValueError("the held-out data has no prompts")
        per_reward, rewards = torch.cat(per_reward), torch.cat(rewards)
        out = {"eval_reward": _nanmean(rewards), "eval_prompts": int(rewards.numel())}
        for i, reward in enumerate(self.rewards):
            out[f"eval_rewards/{reward.name}/mean"] = _nanmean(per_reward[:, i])
        return out


def completion_seed(seed: int, step: int, sample: int, number: int) -> int:
    """The seed of one completion's sampling generator: a hash of (train.seed, step, the
    prompt's stream index, the sample's number), below 2^63."""
    digest = hashlib.sha256(f"{seed}:{step}:{sample}:{number}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def completion_rows(prompt_ids: list[list[int]], completion_ids: list[list[int]],
                    advantages: torch.Tensor, sample_ids: torch.Tensor) -> dict:
    """The rows ``prompt + completion``, right-padded to the longest: ``input_ids``,
    ``labels`` (each completion token at the position that predicts it, IGNORE_INDEX
    elsewhere), ``completion_mask`` (1.0 where a label is; not ``mask``, which the model
    reads as its attention mask), ``advantages`` and ``sample_ids``."""
    width = max(len(p) + len(c) for p, c in zip(prompt_ids, completion_ids))
    ids = torch.zeros(len(prompt_ids), width, dtype=torch.long)
    labels = torch.full_like(ids, IGNORE_INDEX)
    for r, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        ids[r, :len(p) + len(c)] = torch.tensor(p + c, dtype=torch.long)
        if c:
            labels[r, len(p) - 1:len(p) + len(c) - 1] = torch.tensor(c, dtype=torch.long)
    return {"input_ids": ids, "labels": labels,
            "completion_mask": (labels != IGNORE_INDEX).float(), "advantages": advantages.float(), "sample_ids": sample_ids}


def label_logps(logits: torch.Tensor, labels: torch.Tensor,
                temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probability of each label, the entropy at its position), fp32, 0 where there
    is no label, under the logits divided by ``temperature`` (what was sampled)."""
    logp_all = F.log_softmax(logits.float() / temperature, dim=-1)
    keep = labels != IGNORE_INDEX
    logps = logp_all.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1) * keep
    entropy = -(logp_all.exp() * logp_all).sum(-1) * keep
    return logps, entropy


def _nanmean(x: torch.Tensor) -> Optional[float]:
    """The mean of the values a reward gave (None: it applied to none, as TRL logs)."""
    return float(torch.nanmean(x.double())) if bool((~torch.isnan(x)).any()) else None


def _nanstd(x: torch.Tensor) -> float:
    kept = x[~torch.isnan(x)].double()
    return float(kept.std()) if kept.numel() > 1 else 0.0
