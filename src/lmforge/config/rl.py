"""The rules between the ``rl`` section's keys and the rest of a config (GRPO,
``train.objective=grpo``): what ``validate`` refuses, and which ``rl.*`` keys a run uses
(``refuse_ignored`` refuses one set on a run that does not). Each key's own default, help
and range are in ``schema.RLConfig``. Nothing here runs a reward: a user's reward file is
only looked for (it is executed when the run starts, train/rewards.py)."""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Optional

from lmforge.config.derived import objective_name
from lmforge.config.errors import ConfigError, show, show_name
from lmforge.config.keys import RL_OBJECTIVES

BUILTIN_REWARDS = ("exact_answer", "format", "length")  # (train/rewards.py)
PROMPTS_KIND = "prompts"  # the data kind GRPO samples from (data/prompts.py)
# What GRPO's loss, its sampling and its rewards read: a resume that changed one would
# mix two objectives in one run (train/resume_check.py refuses it, as train.beta for DPO).
# rl.max_completion_length and rl.num_iterations may change (a length curriculum).
LOSS_KEYS = ("rl.rewards", "rl.reward_weights", "rl.answer_field", "rl.format_pattern",
             "rl.num_generations", "rl.temperature", "rl.top_p", "rl.beta", "rl.epsilon",
             "rl.epsilon_high", "rl.scale_rewards", "rl.loss_type",
             "rl.mask_truncated_completions")


def reward_names(value: Any) -> list[str]:
    """rl.rewards as a list of names (a comma-separated string is split)."""
    if isinstance(value, str):
        value = value.split(",")
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"rl.rewards: {show(value)} is not a list of rewards")
    return [v.strip() for v in value if v.strip()]


def reward_weights(value: Any, count: int) -> Optional[list[float]]:
    """rl.reward_weights as floats, one per reward (None: 1 each)."""
    if value is None:
        return None
    given = value
    if isinstance(value, str):
        value = value.split(",")
    elif isinstance(value, (int, float)):  # (one reward's weight, as an override gives it)
        value = [value]
    try:
        if any(isinstance(v, bool) for v in value):
            raise TypeError
        weights = [float(v) for v in value]
    except (TypeError, ValueError):
        raise ConfigError(f"rl.reward_weights: {show(given)} is not a list of "
                          f"numbers") from None
    if len(weights) != count:
        raise ConfigError(f"rl.reward_weights: {len(weights)} weights for {count} rewards "
                          f"(rl.rewards); give one per reward")
    bad = next((w for w in weights if not math.isfinite(w)), None)
    if bad is not None:
        raise ConfigError(f"rl.reward_weights: {show(bad)} is not a finite number")
    return weights


def comparable_rewards(values: dict) -> dict:
    """``rl.rewards`` and ``rl.reward_weights`` of flat ``values`` as lists of names and
    of floats, so that a list and a comma-separated string of the same are equal (a value
    that is neither stays as it is: validate refuses it)."""
    out = dict(values)
    try:
        names = reward_names(out["rl.rewards"]) if out.get("rl.rewards") is not None else []
        out["rl.rewards"] = names
        out["rl.reward_weights"] = reward_weights(out.get("rl.reward_weights"), len(names))
    except (ConfigError, KeyError):
        return values
    return out


def validate_rl(cfg, world_size: int = 1) -> None:
    """GRPO needs prompts and prompts GRPO, its rewards must be ones that exist, and it
    runs where its rollout does: one process, FSDP2/DDP and tensor parallelism, not a
    pipeline or context parallelism (``world_size``: any)."""
    objective = objective_name(cfg)
    if cfg.data.kind == PROMPTS_KIND and objective not in RL_OBJECTIVES:
        raise ConfigError(f"train.objective: {objective} does not train on prompts alone "
                          f"(data.kind=prompts); use grpo (or auto)")
    if objective not in RL_OBJECTIVES:
        return
    rl = cfg.rl
    names = reward_names(rl.rewards) if rl.rewards is not None else []
    if not names:
        raise ConfigError("rl.rewards: required with train.objective=grpo (exact_answer, "
                          "format, length or path/to/file.py:function)")
    for name in names:
        user_reward(name)
    reward_weights(rl.reward_weights, len(names))
    if "format" in names:
        check_pattern(rl.format_pattern)
    if rl.max_completion_length >= cfg.data.seq_len:
        raise ConfigError(f"rl.max_completion_length: {rl.max_completion_length} leaves no "
                          f"room for a prompt in data.seq_len={cfg.data.seq_len}")
    if cfg.parallel.pp > 1 or cfg.parallel.cp > 1:
        raise ConfigError("parallel.pp: GRPO samples with the whole model on each rank; use "
                          "parallel.dp_shard and parallel.tp" if cfg.parallel.pp > 1 else
                          "parallel.cp: GRPO needs each completion's log-probabilities on "
                          "one rank; use parallel.dp_shard")
    check_rollout_boundaries(cfg)
    if cfg.data.kind != PROMPTS_KIND:  # (last: what is wrong with the rl keys comes first)
        raise ConfigError(f"train.objective: grpo samples completions of prompts; it needs "
                          f"data.kind={PROMPTS_KIND} (data.kind is {cfg.data.kind})")


def check_rollout_boundaries(cfg) -> None:
    """With rl.num_iterations = k > 1 each rollout trains k steps and is not checkpointed:
    a checkpoint must fall after a rollout's last step (train/grpo.py), so the steps of
    train.checkpoint_every and train.stop_at_step are multiples of k."""
    k = cfg.rl.num_iterations
    for name in ("checkpoint_every", "stop_at_step"):
        every = getattr(cfg.train, name)
        if k > 1 and every and every % k:
            raise ConfigError(f"train.{name}: {every} is not a multiple of "
                              f"rl.num_iterations={k} (a checkpoint falls after a rollout's "
                              f"last step: a rollout is not saved)")


def user_reward(name: str) -> Optional[tuple[Path, str]]:
    """An ``rl.rewards`` entry: None for a built-in, else (the file, the function) of
    ``path/to/file.py:function``; anything else, or a file that is not there, is refused
    (the file is looked for, not run: train/rewards.py loads it)."""
    if name in BUILTIN_REWARDS:
        return None
    path, sep, func = name.rpartition(":")
    if not sep or not path.endswith(".py") or not func.isidentifier():
        raise ConfigError(f"rl.rewards: {show(name)} is neither a built-in reward "
                          f"({', '.join(BUILTIN_REWARDS)}) nor path/to/file.py:function")
    if not Path(path).is_file():
        raise ConfigError(f"rl.rewards: {show_name(path)}: no such file (from {show(name)})")
    return Path(path), func


def check_pattern(pattern: Optional[str]) -> str:
    """``rl.format_pattern``, refused unless it is a regular expression; returned."""
    if not pattern:
        raise ConfigError("rl.format_pattern: the format reward needs a regular expression "
                          "(rl.format_pattern=...)")
    try:
        re.compile(pattern)
    except re.error as e:
        raise ConfigError(f"rl.format_pattern: {show(pattern)} is not a regular expression "
                          f"({e})") from None
    return pattern


def rl_key_users(cfg, objective: str) -> list[tuple[str, str, Optional[str]]]:
    """``refuse_ignored``'s rows for the rl section: (key, what uses it, what this run is
    where it does not use it, else None). Every rl.* key is GRPO's; rl.format_pattern is
    read by the format reward, rl.answer_field by exact_answer."""
    grpo = objective in RL_OBJECTIVES  # (objective_name: auto is grpo for prompts)
    rows = [(f"rl.{name}", "train.objective=grpo", None if grpo else objective)
            for name in cfg.rl.__dataclass_fields__]
    if not grpo:
        return rows
    rows.append(("train.loss_chunk_tokens", "the next-token and preference objectives",
                 "train.objective=grpo"))  # (its loss scores whole rollout rows)
    try:
        names = reward_names(cfg.rl.rewards) if cfg.rl.rewards is not None else []
    except ConfigError:
        return rows  # (validate names it)
    for key, reward in (("rl.format_pattern", "format"), ("rl.answer_field", "exact_answer")):
        rows.append((key, f"the {reward} reward", None if reward in names else
                     f"rl.rewards={','.join(names) or 'none'}"))
    return rows
