"""How a config key is declared: ``key(default, help, choices=..., bound=...)`` beside the
field in ``schema.py``, so that its allowed values and its help live in one place, read by
``validate`` (``checks.py``) and by ``lmforge train --help`` (``describe_keys``)."""
from __future__ import annotations

import dataclasses
import textwrap
from dataclasses import field
from typing import Any, Callable, Iterator, Optional

from lmforge.config.errors import show, show_name

DEVICES = ("auto", "cpu", "cuda")  # train.device, and every command's --device
# train.objective values that compare a chosen and a rejected completion
PREFERENCE_OBJECTIVES = ("dpo", "ipo", "simpo", "orpo")
RL_OBJECTIVES = ("grpo",)  # train.objective values that learn from sampled completions
RL_LOSS_TYPES = ("grpo", "dr_grpo", "dapo")  # rl.loss_type (models/grpo.py)
RL_SCALE_REWARDS = ("group", "batch", "none")  # rl.scale_rewards
AUTO = "auto"  # data.micro_batch_size's word for "the largest that fits" (perf/auto_batch.py)


class IntOrAuto:
    """A key's type: an integer, or the word ``auto`` (a number once the run sizes it);
    ``loading`` coerces to it, never to a string that merely starts with auto."""


# Each preference setting and the objectives whose loss reads it (models/preference.py):
# set on another objective it would change nothing, so it is refused (checks.py).
OBJECTIVE_KEYS = {"train.beta": ("dpo", "ipo", "simpo"),
                  "train.label_smoothing": ("dpo", "simpo"),
                  "train.simpo_gamma": ("simpo",),
                  "train.orpo_lambda": ("orpo",),
                  "train.reference": ("dpo", "ipo")}  # (simpo and orpo have no reference)

# A numeric key's range, by the words its error and --help show.
# The smallest sampling temperature but 0 (greedy): below it the draw is the argmax's but
# for rounding, and logits / T overflow float32 (models/sampling.py says more). rl.temperature
# and `lmforge generate --temperature` keep to it alike.
MIN_TEMPERATURE = 0.01
SAMPLING_TEMPERATURE = f">= {MIN_TEMPERATURE}"

BOUNDS: dict[str, Callable[[Any], bool]] = {
    "> 0": lambda v: v > 0,
    "> 0, or auto": lambda v: v == AUTO or v > 0,
    ">= 0": lambda v: v >= 0,
    ">= 1": lambda v: v >= 1,
    ">= 2": lambda v: v >= 2,
    "in (0, 1]": lambda v: 0 < v <= 1,
    "-1 (the rest of the world size) or >= 1": lambda v: v == -1 or v >= 1,
    # Seeds offset by the step and the rank must stay below torch's limit, 2^64.
    "in [0, 2^63)": lambda v: 0 <= v < 2**63,
    "in [0, 1]": lambda v: 0 <= v <= 1,
    "in [0, 1)": lambda v: 0 <= v < 1,
    "in [0, 0.5)": lambda v: 0 <= v < 0.5,
    SAMPLING_TEMPERATURE: lambda v: v >= MIN_TEMPERATURE,
}


def key(default: Any, help: str, *, choices: tuple = (), bound: Optional[str] = None,
        free_form: Optional[str] = None,
        mapping: Optional[Callable[[dict], Optional[tuple[str, str]]]] = None):
    """A config field: its default, one line of help, and what it may hold: one of
    ``choices`` (or, with ``free_form``, a value that contains "{": such a format string),
    or a number in ``bound`` (a key of ``BOUNDS``; None passes), or a mapping whose keys
    ``mapping`` checks (it returns the key at fault and why, or None)."""
    if bound is not None and bound not in BOUNDS:
        raise ValueError(f"unknown bound {bound!r}")  # a schema error, caught by the tests
    return field(default=default, metadata={"help": help, "choices": tuple(choices),
                                            "bound": bound, "free_form": free_form,
                                            "mapping": mapping})


def config_keys(cfg) -> Iterator[tuple[str, dataclasses.Field, Any]]:
    """(section.key, its field, its value in ``cfg``) for every key of a JobConfig."""
    for section in dataclasses.fields(cfg):
        values = getattr(cfg, section.name)
        for f in dataclasses.fields(values):
            yield f"{section.name}.{f.name}", f, getattr(values, f.name)


def allowed(f: dataclasses.Field, value: Any) -> Optional[str]:
    """Why ``value`` may not be given to ``f`` (None: it may)."""
    meta = f.metadata
    choices = meta.get("choices")
    if choices and value not in choices:
        if not (meta.get("free_form") and "{" in str(value)):
            return f"{show(value)} is not one of {', '.join(map(str, choices))}"
    bound = meta.get("bound")
    if bound and value is not None and not BOUNDS[bound](value):
        return f"must be {bound}, got {show(value)}"
    return None


def mapping_problem(dotted: str, f: dataclasses.Field, value: Any) -> Optional[str]:
    """Why a mapping-valued key's ``value`` is refused, as the whole message naming the
    key at fault inside it (``model.rope_scaling.bogus: ...``); None: it is not."""
    check = f.metadata.get("mapping")
    if check is None or value is None:
        return None
    if not isinstance(value, dict):
        return f"{dotted}: {show(value)} is not a mapping"
    problem = check(value)
    return None if problem is None else f"{dotted}.{show_name(problem[0])}: {problem[1]}"


def describe_keys(cfg, width: int = 88) -> str:
    """Every key with its default, what it may hold and its help: ``--help``'s list."""
    lines = []
    for dotted, f, value in config_keys(cfg):
        meta = f.metadata
        what = [f"default {value!r}"]
        if meta.get("choices"):
            what.append("one of " + ", ".join(map(str, meta["choices"])))
        if meta.get("free_form"):
            what.append("or " + meta["free_form"])
        if meta.get("bound"):
            what.append(meta["bound"])
        lines.append(f"  {dotted} ({'; '.join(what)})")
        lines.extend(textwrap.wrap(meta.get("help", ""), width, initial_indent="      ",
                                   subsequent_indent="      "))
    return "\n".join(lines)
