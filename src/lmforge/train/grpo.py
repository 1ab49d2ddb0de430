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
   its adapters off (LoRA) or a frozen copy of the starting weights; with
   ``rl.num_iterations > 1`` the policy's own (``old_logps``: the rollout's policy).

Every layout (one process, FSDP2, tensor parallelism) samples with the policy as it is
sharded; under data parallelism each rank decodes its own prompts, every rank stepping
until all are done (``generate(group=...)``). Groups are a prompt's completions, so a
rank's advantages are its own, except ``rl.scale_rewards=batch``: its std, the step's
unit-to-token scale and the rollout's metrics are over the whole step of every rank
(gathered), so that a layout gives one process's losses.

``rl.num_iterations`` = k: the step that samples a rollout and the k - 1 after it train on
it (TRL's GRPOTrainer with steps_per_generation = gradient accumulation), the ratio
against the rollout's log-probabilities; those steps read no prompts. A checkpoint falls
only where the next step samples (``config/rl.py`` refuses a train.checkpoint_every or
train.stop_at_step that is not a multiple of k, and a stop signal waits for a rollout's
last step), so a resumed run continues exactly; a run resumed from a final checkpoint
inside a rollout (train.max_steps not a multiple of k) samples afresh, as TRL does.
The metrics carry TRL's names, with the seconds spent generating, scoring and training.
"""
from __future__ import annotations

import contextlib
import hashlib
import math
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from lmforge import IGNORE_INDEX
from lmforge.models.generate import generate
from lmforge.models.grpo import (GRPOParams, group_advantages, loss_sum, per_token_loss,
                                 units, without_truncated)
from lmforge.models.loss import fused_head, fused_label_logps, model_inputs
from lmforge.models.sampling import GREEDY, Sampling
from lmforge.peft.lora import adapters_disabled
from lmforge.train.rewards import Reward, score, weighted_sum

# the per-token metrics loss_sum sums (each over completion tokens)
TOKEN_METRICS = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean",
                 "clip_ratio/region_mean")
# and the extremes over the step's completions of each one's clipped fraction (TRL's
# names; ``train.preference.mean_stats`` takes a ``_min``/``_max`` stat's min/max)
EXTREME_METRICS = ("clip_ratio/low_min", "clip_ratio/high_max")


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
    num_iterations: int = 1
    name = "grpo"
    # step units / step completion tokens: loss_sum's token sums become token means
    # when mean_stats divides them by the step's units
    _scale: float = field(default=1.0, init=False, repr=False)
    # the rollout the next num_iterations - 1 steps train on again (None: none yet)
    _rollout: Optional[list] = field(default=None, init=False, repr=False)

    @property
    def unit(self) -> str:  # (what metrics.jsonl names the count)
        return "completion_tokens" if self.params.loss_type == "dapo" else "completions"

    def count(self, batch: dict) -> int:
        return int(units(batch["completion_mask"], self.params.loss_type))

    # ------------------------------------------------------------------ the rollout
    def takes_new_batches(self, step: int) -> bool:
        """Whether step ``step`` samples a rollout of new prompts (else it trains on the
        last one again: rl.num_iterations); the loop reads no data for a step that does
        not, and stops for a signal only before one that does."""
        return self._rollout is None or (step - 1) % self.num_iterations == 0

    def prepare(self, tm, micro_batches: list[dict], step: int, device: torch.device,
                autocast=contextlib.nullcontext) -> tuple[list[dict], dict]:
        """The step's micro-batches of completions, and the rollout's metrics (a step
        given no prompts trains on the last rollout again and logs only its times)."""
        if not micro_batches:
            return self._rollout, {"time/generate_s": 0.0, "time/score_s": 0.0}
        model, group = tm.parts[0], _dp_group(tm.dims)
        times = {"generate": 0.0, "score": 0.0}
        rollouts, per_reward = [], []
        for prompts in micro_batches:
            t0 = time.perf_counter()
            rows = self._generate(model, prompts, step, group=group)
            t1 = time.perf_counter()
            per_reward.append(self._rewards(prompts, rows))
            times["generate"] += t1 - t0
            times["score"] += time.perf_counter() - t1
            rollouts.append(rows)
        t1 = time.perf_counter()
        # the whole step's completions, every rank's (in rank order): a group is one
        # prompt's, but scale_rewards=batch and the metrics are the step's
        per_reward = torch.cat(per_reward)
        local = torch.cat([weighted_sum(per_reward, self._weights())[:, None], per_reward,
                           _lengths(rollouts)], dim=1).double()
        table = _gather_rows(local, group, device)
        # (float64, as the rewards were summed: a reward of 1e39 is a number, not inf)
        advantages, zero_std = group_advantages(table[:, 0], self.num_generations,
                                                self.scale_rewards)
        mine = advantages.view(max(tm.dims.dp, 1) if group else 1, -1)[
            tm.dims.dp_rank if group else 0]
        out = self._batches(micro_batches, rollouts, mine.float(),
                            getattr(model, "sequence_shards", 1))
        times["score"] += time.perf_counter() - t1
        with tm.loss_context():  # (tensor parallelism: log-probabilities of vocab shards)
            for batch in out:
                if self.params.beta:
                    batch["ref_logps"] = self._reference_logps(model, batch, device, autocast)
                if self.num_iterations > 1:  # (the later steps' ratio is to this policy)
                    batch["old_logps"] = self._policy_logps(model, batch, device, autocast)
        self._scale = _step_scale(out, self, group, device)
        self._rollout = out
        r = len(self.rewards)
        return out, self._rollout_metrics(table[:, 1:1 + r], table[:, 0], zero_std,
                                          table[:, 1 + r].tolist(),
                                          table[:, 2 + r].bool().tolist(), times)

    def _weights(self) -> torch.Tensor:
        return torch.tensor([r.weight for r in self.rewards], dtype=torch.float64)

    def _batches(self, micro_batches: list[dict], rollouts: list, advantages: torch.Tensor,
                 multiple: int = 1) -> list[dict]:
        """Each micro-batch's rows (``completion_rows``) with its share of ``advantages``."""
        out, first, g = [], 0, self.num_generations
        for prompts, rows in zip(micro_batches, rollouts):
            prompt_ids = [p for p in prompts["prompts"].ids for _ in range(g)]
            batch = completion_rows(prompt_ids, [c.ids for c in rows],
                                    advantages[first:first + len(rows)],
                                    prompts["sample_ids"].repeat_interleave(g), multiple)
            if self.params.mask_truncated_completions:
                cut = torch.tensor([c.finish_reason == "length" for c in rows])
                batch["completion_mask"] = without_truncated(batch["completion_mask"], cut)
            out.append(batch)
            first += len(rows)
        return out

    def _generate(self, model: nn.Module, prompts: dict, step: int,
                  sampling: Optional[Sampling] = None, per_prompt: Optional[int] = None,
                  group=None):
        batch = prompts["prompts"]
        g = self.num_generations if per_prompt is None else per_prompt
        ids = [p for p in batch.ids for _ in range(g)]
        seeds = [completion_seed(self.seed, step, int(s), j)
                 for s in prompts["sample_ids"].tolist() for j in range(g)]
        was_training = model.training
        model.eval()  # (LoRA dropout off: the rollout samples the policy itself)
        try:
            return generate(model, ids, self.params.max_completion_length,
                            sampling or self.sampling, stop_ids=batch.stop_ids, seeds=seeds,
                            group=group)
        finally:
            model.train(was_training)

    def _rewards(self, prompts: dict, rows, per_prompt: Optional[int] = None
                 ) -> torch.Tensor:
        """(completions, rewards) each reward's value of each completion (NaN: none)."""
        batch = prompts["prompts"]
        g = self.num_generations if per_prompt is None else per_prompt
        records = [r for r in batch.records for _ in range(g)]
        # as TRL: a chat prompt's completion is an assistant message, a text's is text
        texts = [batch.tokenizer.decode(c.ids) for c in rows]
        texts = [[{"role": "assistant", "content": t}] if isinstance(r["prompt"], list)
                 else t for t, r in zip(texts, records)]
        fields = {k: [r.get(k) for r in records]
                  for k in dict.fromkeys(k for r in records for k in r if k != "prompt")}
        return score(self.rewards, [r["prompt"] for r in records], texts,
                     [c.ids for c in rows], fields)

    @torch.no_grad()
    def _reference_logps(self, model, batch, device, autocast) -> torch.Tensor:
        if self.reference == "adapters_off":
            with adapters_disabled(model):
                return self._logps(model, batch, device, autocast)[0]
        return self._logps(self.reference_model, batch, device, autocast)[0]

    @torch.no_grad()
    def _policy_logps(self, model, batch, device, autocast) -> torch.Tensor:
        return self._logps(model, batch, device, autocast)[0]

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
        old = batch.get("old_logps")  # (rl.num_iterations > 1: the rollout's policy)
        token_loss, parts = per_token_loss(logps, None if old is None else old.to(device),
                                           None if ref is None else ref.to(device),
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
        # each completion's clipped fraction; +-inf where none has a token (every rank
        # holds the stat, so that the step's reduction is one collective)
        tokens = mask.sum(-1)
        kept = tokens > 0
        for name, v, pick, none in (("clip_ratio/low_min", low, torch.min, math.inf),
                                    ("clip_ratio/high_max", high, torch.max, -math.inf)):
            frac = (v * mask).sum(-1)[kept] / tokens[kept].double()
            value = pick(frac) if frac.numel() else frac.new_tensor(none)
            stats[name] = pick(stats[name], value) if name in stats else value

    def stage_loss_sum(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        raise ValueError("parallel.pp: GRPO does not run in a pipeline")

    # ------------------------------------------------------------------ held out
    @torch.no_grad()
    def held_out(self, tm, batches, device: torch.device, autocast) -> dict[str, float]:
        """One greedy completion per held-out prompt: ``eval_reward`` (the mean weighted
        reward) and ``eval_rewards/<name>/mean``, ``eval_prompts``."""
        model, group = tm.parts[0], _dp_group(tm.dims)
        per_reward = []
        for prompts in batches:
            rows = self._generate(model, prompts, 0, GREEDY, per_prompt=1, group=group)
            distinct = prompts["prompts"].distinct
            if distinct and not bool((prompts["sample_ids"] < distinct).any()):
                continue  # (a rank past the held-out prompts decodes fillers to keep its
                # collectives in step: loader.held_out_batches; they are not scored)
            per_reward.append(self._rewards(prompts, rows, per_prompt=1))
        per_reward = (torch.cat(per_reward) if per_reward else
                      torch.empty(0, len(self.rewards)))
        rewards = weighted_sum(per_reward, self._weights())
        # (sum, count) of the weighted reward and of each reward, over every rank
        columns = torch.cat([rewards[:, None], per_reward], dim=1).double()
        sums = torch.stack([columns.nansum(0), (~torch.isnan(columns)).sum(0).double(),
                            columns.new_full((columns.shape[1],), float(len(columns)))])
        if group is not None:
            sums = sums.to(device)
            dist.all_reduce(sums, group=group)
        sums = sums.cpu()
        if not int(sums[2, 0]):
            raise ValueError("the held-out data has no prompts")

        def mean(i):  # (None: the reward applied to none, as TRL logs)
            return float(sums[0, i] / sums[1, i]) if sums[1, i] else None

        out = {"eval_reward": mean(0), "eval_prompts": int(sums[2, 0])}
        for i, reward in enumerate(self.rewards, 1):
            out[f"eval_rewards/{reward.name}/mean"] = mean(i)
        return out


def _dp_group(dims):
    """The data-parallel process group whose ranks decode their own prompts (None: one
    rank of data, as in one process or under tensor parallelism alone)."""
    return dims.group("dp") if dims.mesh is not None and dims.dp > 1 else None


def _lengths(rollouts: list) -> torch.Tensor:
    """(completions, 2): each completion's length and whether it was cut at the limit."""
    return torch.tensor([[len(c.ids), c.finish_reason == "length"] for rows in rollouts
                         for c in rows], dtype=torch.float32)


def _gather_rows(local: torch.Tensor, group, device: torch.device) -> torch.Tensor:
    """The rows of every rank of ``group``, in rank order (each rank holds as many: the
    same prompts a step, rl.num_generations completions each)."""
    if group is None:
        return local
    parts = [torch.empty_like(local, device=device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.to(device), group=group)
    return torch.cat(parts).cpu()


def _step_scale(batches: list[dict], objective: "GRPO", group, device) -> float:
    """The step's units over its completion tokens, every rank's (``_add_token_stats``)."""
    counts = torch.tensor([sum(objective.count(b) for b in batches),
                           sum(float(b["completion_mask"].sum()) for b in batches)],
                          dtype=torch.float64)
    if group is not None:
        counts = counts.to(device)
        dist.all_reduce(counts, group=group)
    units, tokens = counts.tolist()
    return units / max(tokens, 1.0)


def completion_seed(seed: int, step: int, sample: int, number: int) -> int:
    """The seed of one completion's sampling generator: a hash of (train.seed, step, the
    prompt's stream index, the sample's number), below 2^63."""
    digest = hashlib.sha256(f"{seed}:{step}:{sample}:{number}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def completion_rows(prompt_ids: list[list[int]], completion_ids: list[list[int]],
                    advantages: torch.Tensor, sample_ids: torch.Tensor,
                    multiple: int = 1) -> dict:
    """The rows ``prompt + completion``, right-padded to the longest: ``input_ids``,
    ``labels`` (each completion token at the position that predicts it, IGNORE_INDEX
    elsewhere), ``completion_mask`` (1.0 where a label is; not ``mask``, which the model
    reads as its attention mask), ``advantages`` and ``sample_ids``. ``multiple``: the
    width is rounded up to one (sequence parallelism splits it over its ranks)."""
    width = max(len(p) + len(c) for p, c in zip(prompt_ids, completion_ids))
    width = -(-width // multiple) * multiple
    ids = torch.zeros(len(prompt_ids), width, dtype=torch.long)
    labels = torch.full_like(ids, IGNORE_INDEX)
    for r, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        ids[r, :len(p) + len(c)] = torch.tensor(p + c, dtype=torch.long)
        if c:
            labels[r, len(p) - 1:len(p) + len(c) - 1] = torch.tensor(c, dtype=torch.long)
    return {"input_ids": ids, "labels": labels,
            "completion_mask": (labels != IGNORE_INDEX).float(),
            "advantages": advantages.float(), "sample_ids": sample_ids}


def label_logps(logits: torch.Tensor, labels: torch.Tensor,
                temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probability of each label, the entropy at its position), fp32, 0 where there
    is no label, under the logits divided by ``temperature`` (what was sampled)."""
    logp_all = F.log_softmax(logits.float() / temperature, dim=-1)
    keep = labels != IGNORE_INDEX
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    # (nll_loss picks each label's value: also from a vocabulary sharded by tensor
    # parallelism, under loss_parallel, with a plain target as the other objectives' losses)
    logps = -F.nll_loss(logp_all.flatten(0, -2), labels.flatten(),
                        ignore_index=IGNORE_INDEX, reduction="none").view(labels.shape)
    if isinstance(logp_all, DTensor):
        logps, entropy = logps.full_tensor(), entropy.full_tensor()
    return logps * keep, entropy * keep


def _nanmean(x: torch.Tensor) -> Optional[float]:
    """The mean of the values a reward gave (None: it applied to none, as TRL logs)."""
    return float(torch.nanmean(x.double())) if bool((~torch.isnan(x)).any()) else None


def _nanstd(x: torch.Tensor) -> float:
    kept = x[~torch.isnan(x)].double()
    return float(kept.std()) if kept.numel() > 1 else 0.0
