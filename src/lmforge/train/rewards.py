"""Reward functions for GRPO (rl.rewards): the built-ins that need no code (``exact_answer``,
``format``, ``length``) and the user's own functions, named ``path/to/file.py:function``.

Every reward has TRL's signature, so a function written for TRL runs here unchanged:
``f(prompts=[...], completions=[...], completion_ids=[[...], ...], **fields)`` where each
field (``answer``, ``tests``, ...) is a list holding that field of each completion's record;
it returns one float per completion, or None where the reward does not apply (TRL's
meaning: a None is left out of the weighted sum, and a completion no reward applies to gets
no advantage). ``score`` runs them all and refuses, naming the function and the record, a
reward that raises (``SystemExit`` too: only ``KeyboardInterrupt`` stays an interrupt),
returns something other than a list, the wrong count, a value that is not a finite number,
or one whose weighted sum is not finite (rewards are summed in float64). Each reward is
given its own copies of the prompts, completions, ids and fields: what one changes reaches
neither the next reward, nor the rows the step trains on, nor the dataset's records.

A user's reward function is the user's code: loading it executes that file, with the
rights of the training process (docs/security.md).
"""
from __future__ import annotations

import copy
import importlib.util
import inspect
import math
import numbers
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from lmforge.config.errors import ConfigError, show, show_name
from lmforge.config.rl import check_pattern, user_reward


_NUMBER = re.compile(r"[-+]?(?:\d[\d,]*(?:\.\d*)?|\.\d+)(?:/\d+)?")
_LATEX_FRAC = re.compile(r"^\\[dt]?frac\{\s*([-+]?\d+)\s*\}\{\s*(\d+)\s*\}$")
_PROMPT_SHOWN = 40  # characters of a prompt an error quotes


class RewardError(ValueError):
    """A reward function failed on a batch: the message names it and the record."""


# ---------------------------------------------------------------- answers
def extract_answer(text: str) -> Optional[str]:
    """The final answer a completion states: the content of its last ``\\boxed{...}``
    (braces balanced), else the line after its last ``####``, else its last number; None
    when it states none."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    if "####" in text:
        after = text.rsplit("####", 1)[1].strip()
        return after.splitlines()[0].strip() if after else None
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _last_boxed(text: str) -> Optional[str]:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None  # unclosed: no boxed answer


def normalize_answer(answer: Any) -> Any:
    """A number as an exact ``Fraction`` (``1,000`` = ``1000``, ``2.50`` = ``2.5``,
    ``1/2`` = ``0.5`` = ``\frac{1}{2}``, a leading ``$`` or trailing ``.``/``%``
    dropped), anything else as its text with whitespace collapsed and case kept."""
    if isinstance(answer, bool):
        return str(answer)
    if isinstance(answer, (int, float)):
        return Fraction(answer).limit_denominator(10**12) if math.isfinite(answer) else None
    text = " ".join(str(answer).split())
    text = _LATEX_FRAC.sub(r"\1/\2", text)
    number = text.strip("$").rstrip(".%").replace(",", "").replace(" ", "")
    if re.fullmatch(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:/\d+)?", number):
        try:
            return Fraction(number)
        except ZeroDivisionError:  # "1/0": not a number, compared as text
            return text
    return text


def answers_equal(completion: str, expected: Any) -> bool:
    """Whether the completion's final answer is ``expected``; an expected answer that is a
    worked solution (GSM8K's "... #### 72", or one with a ``\boxed{}``) is read for its
    final answer the same way."""
    found = extract_answer(completion)
    if isinstance(expected, str) and ("####" in expected or "\\boxed{" in expected):
        expected = extract_answer(expected)
    return (found is not None and expected is not None
            and normalize_answer(found) == normalize_answer(expected))


# ---------------------------------------------------------------- built-ins
def exact_answer_reward(answer_field: str) -> Callable:
    """1.0 when the completion's final answer (``extract_answer``) equals the record's
    ``answer_field`` after ``normalize_answer``, else 0.0; None for a record without it."""
    def exact_answer(prompts, completions, **fields):
        expected = fields.get(answer_field) or [None] * len(completions)
        return [None if want is None else float(answers_equal(_text(c), want))
                for c, want in zip(completions, expected)]
    return exact_answer


def format_reward(pattern: str) -> Callable:
    """1.0 when the whole completion matches ``pattern`` (``re.fullmatch`` with DOTALL, so
    ``.`` crosses lines and the pattern describes the completion from its first character
    to its last), else 0.0."""
    compiled = re.compile(pattern, re.DOTALL)

    def format_reward(prompts, completions, **fields):
        return [float(compiled.fullmatch(_text(c)) is not None) for c in completions]
    format_reward.__name__ = "format"  # its metric: rewards/format/mean
    return format_reward


def length_reward(max_completion_length: int) -> Callable:
    """A length penalty: -(completion tokens) / rl.max_completion_length, in [-1, 0]: 0 for
    an empty completion, -1 for one cut at the limit."""
    def length(prompts, completions, completion_ids=None, **fields):
        return [-len(ids) / max_completion_length for ids in completion_ids]
    return length


def _text(completion: Any) -> str:
    """A completion's text: a string, or the content of chat messages (TRL's
    conversational form: ``[{"role": "assistant", "content": ...}]``)."""
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))
    return str(completion)


# ---------------------------------------------------------------- loading
@dataclass(frozen=True)
class Reward:
    name: str  # the metric's name: rewards/<name>/mean
    func: Callable
    weight: float


def load_rewards(specs: Sequence[str], weights: Optional[Sequence[float]] = None, *,
                 answer_field: str = "answer", format_pattern: Optional[str] = None,
                 max_completion_length: int = 256) -> list[Reward]:
    """The rewards rl.rewards names, with rl.reward_weights (default: 1 each)."""
    if not specs:
        raise ConfigError("rl.rewards: name at least one reward (exact_answer, format, "
                          "length or path/to/file.py:function)")
    if weights is not None and len(weights) != len(specs):
        raise ConfigError(f"rl.reward_weights: {len(weights)} weights for {len(specs)} "
                          f"rewards (rl.rewards); give one per reward")
    rewards = []
    for i, spec in enumerate(specs):
        weight = 1.0 if weights is None else float(weights[i])
        if not math.isfinite(weight):
            raise ConfigError(f"rl.reward_weights: {show(weights[i])} is not a finite number")
        if spec == "exact_answer":
            func = exact_answer_reward(answer_field)
        elif spec == "format":
            func = format_reward(check_pattern(format_pattern))
        elif spec == "length":
            func = length_reward(max_completion_length)
        else:
            func = load_user_function(spec)
        name = _unique(str(getattr(func, "__name__", spec)), {r.name for r in rewards})
        rewards.append(Reward(name, func, weight))
    return rewards


def _unique(name: str, taken: set) -> str:
    """``name``, or ``name_2``, ``name_3``...: two rewards of one name (two files' ``f``)
    keep separate metrics (rewards/<name>/mean)."""
    number, unique = 1, name
    while unique in taken:
        number += 1
        unique = f"{name}_{number}"
    return unique


def load_user_function(spec: str) -> Callable:
    """``path/to/file.py:function`` (the path relative to the working directory): that
    file executed as a module, and its function, checked to take TRL's arguments."""
    file, name = user_reward(str(spec)) or (None, None)
    if file is None:
        raise ConfigError(f"rl.rewards: {show(spec)} is a built-in reward, not a file")
    module_name = f"lmforge_rewards_{abs(hash(str(file.resolve())))}"
    module = sys.modules.get(module_name)  # executed once a process (the policy and its
    if module is not None:                 # reference copy both build the objective)
        return _function(spec, file, module, name)
    try:
        module_spec = importlib.util.spec_from_file_location(module_name, file)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module
        module_spec.loader.exec_module(module)
    except KeyboardInterrupt:  # (Ctrl-C while it loads: an interrupt, not the file's fault)
        sys.modules.pop(module_name, None)
        raise
    except BaseException as e:  # the user's file: whatever it raises (sys.exit too) is
        sys.modules.pop(module_name, None)  # theirs to fix, and must not end the run quietly
        raise ConfigError(f"rl.rewards: loading {show_name(file)} failed: "
                          f"{_described(e)}") from None
    return _function(spec, file, module, name)


def _function(spec: str, file: Path, module, name: str) -> Callable:
    func = getattr(module, name, None)
    if not callable(func):
        raise ConfigError(f"rl.rewards: {show_name(file)} defines no function {name!r}")
    _check_signature(spec, func)
    return func


def _check_signature(spec: str, func: Callable) -> None:
    """TRL calls ``func(prompts=..., completions=..., completion_ids=..., **fields)``:
    it must take ``prompts`` and ``completions`` by name and any other keyword."""
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):
        return  # (a builtin without a signature: its first call says what is wrong)
    kinds = {p.kind for p in params.values()}
    named = {n for n, p in params.items()
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if not {"prompts", "completions"} <= named or inspect.Parameter.VAR_KEYWORD not in kinds:
        raise ConfigError(f"rl.rewards: {show(spec)} takes {inspect.signature(func)}; a reward "
                          f"takes (prompts, completions, **kwargs) as in TRL")


# ---------------------------------------------------------------- scoring
def score(rewards: Sequence[Reward], prompts: list, completions: list,
          completion_ids: list, fields: dict[str, list]) -> torch.Tensor:
    """(completions, rewards) float64: each reward's value per completion, NaN where it
    returned None. ``fields``: each record field, one value per completion. Refuses a
    weighted sum that is not finite (``weighted_sum``), naming the reward."""
    columns = []
    for reward in rewards:
        try:
            values = _call(reward, prompts, completions, completion_ids, fields)
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # (SystemExit too: a reward cannot end the run quietly)
            where = _failing_record(reward, prompts, completions, completion_ids, fields)
            raise RewardError(f"reward {reward.name}: raised {_described(e)} "
                              f"({where})") from None
        columns.append(_check_values(reward.name, values, prompts))
    table = torch.tensor(columns, dtype=torch.float64).T.reshape(len(prompts), len(rewards))
    _check_weighted(rewards, table, prompts)
    return table


def _call(reward: Reward, prompts, completions, completion_ids, fields):
    """``reward`` on copies of its arguments: the caller's lists, and the records the
    fields hold, are out of its reach."""
    args = copy.deepcopy({"prompts": prompts, "completions": completions,
                          "completion_ids": completion_ids, **fields})
    return reward.func(**args)


def _described(error: BaseException) -> str:
    """``Type: message`` of what a user's code raised (``Type`` alone without one)."""
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _failing_record(reward: Reward, prompts, completions, completion_ids, fields) -> str:
    """Which record a reward raised on: the batch is called again one completion at a
    time (a reward is a function of its inputs), and the first that raises is named;
    the whole batch when each alone passes."""
    for i in range(len(prompts)):
        try:
            _call(reward, prompts[i:i + 1], completions[i:i + 1], completion_ids[i:i + 1],
                  {k: v[i:i + 1] for k, v in fields.items()})
        except KeyboardInterrupt:
            raise
        except BaseException:
            return f"for {_record(prompts, i)}"
    return f"on the batch of {len(prompts)} starting at {_record(prompts, 0)}"


def _check_values(name: str, values: Any, prompts: list) -> list[float]:
    try:
        # (a dict, a set or a string iterates, but holds no value per completion in order)
        if isinstance(values, (Mapping, str, bytes, set, frozenset)):
            raise TypeError
        values = list(values)
    except TypeError:
        raise RewardError(f"reward {name}: returned {_shown(values)}, not a list with one "
                          f"float or None per completion") from None
    if len(values) != len(prompts):
        raise RewardError(f"reward {name}: returned {len(values)} values for "
                          f"{len(prompts)} completions (one float or None per completion)")
    return [_value(name, v, prompts, i) for i, v in enumerate(values)]


def _value(name: str, v: Any, prompts: list, i: int) -> float:
    """One returned value as a float (NaN for None), else refused naming the record."""
    if v is None:
        return math.nan
    # (numbers.Real: numpy's scalars too, as TRL's torch.tensor(values) takes them)
    if not isinstance(v, bool) and isinstance(v, numbers.Real):
        try:
            value = float(v)
        except OverflowError:  # (an int beyond a float's range)
            value = math.inf
        if math.isfinite(value):
            return value
    raise RewardError(f"reward {name}: {_shown(v)} is not a finite number or None "
                      f"(for {_record(prompts, i)})")


def _shown(value: Any) -> str:
    """A returned value as a message quotes it (``show``), even where its repr fails."""
    try:
        return show(value)
    except Exception:
        return f"a {type(value).__name__}"


def _check_weighted(rewards: Sequence[Reward], table: torch.Tensor, prompts: list) -> None:
    """Refuses a completion whose weighted sum is not finite, naming the reward whose
    term made it so (the sum taken in ``rewards``' order, as ``weighted_sum`` adds)."""
    for i, row in enumerate(table.tolist()):
        total = 0.0
        for reward, value in zip(rewards, row):
            if math.isnan(value):
                continue
            total += value * reward.weight
            if not math.isfinite(total):
                raise RewardError(
                    f"reward {reward.name}: {show(value)} x its weight {show(reward.weight)} "
                    f"(rl.reward_weights) makes the weighted reward not finite "
                    f"(for {_record(prompts, i)})")


def _record(prompts: list, i: int) -> str:
    """Completion ``i``'s record, as an error names it: its index and its prompt's start."""
    prompt = _text(prompts[i]) if i < len(prompts) else ""
    return f"completion {i}, prompt {show(prompt, _PROMPT_SHOWN)}"


def weighted_sum(per_reward: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each completion's reward: the weighted sum of the rewards that apply (a None is
    left out: a NaN-aware sum), in float64; NaN where none applies (TRL's "unscorable")."""
    per_reward = per_reward.double()
    total = (per_reward * weights.double()[None, :]).nansum(dim=1)
    return total.masked_fill(torch.isnan(per_reward).all(dim=1), math.nan)
