"""Prompts (``data.kind=prompts``), what GRPO samples completions of: JSON Lines records
with a ``prompt``, either a string (tokenized as it is, as TRL does with a plain prompt)
or chat messages (rendered with the model's chat template, ``data.template``, and its
generation prompt), and any other fields (``answer``, ``tests``, ...), which reach the
reward functions untouched (``train/rewards.py``).

A record that is not an object, has no ``prompt``, a blank one, a message that is not
a ``{"role", "content"}`` turn ending with a user turn, or a field named like an argument
every reward takes (``prompts``, ``completions``, ``completion_ids``: the fields are passed
as keywords beside them) is refused with ``file:line``; so is a prompt whose tokens leave
no room for ``rl.max_completion_length`` new ones within ``data.seq_len``. A file none of
whose records holds the field the ``exact_answer`` reward reads (``rl.answer_field``: a
typo would score nothing, every step) is refused naming the field. The stream of
samples is the records in a fresh shuffle each epoch (seeded by train.seed), and a sample
is a record's index: a batch is its prompts' ids and records, which GRPO's rollout
(``train/grpo.py``) turns into completions.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from lmforge.config.errors import show_name
from lmforge.data.dataset import rng_for, split_documents
from lmforge.data.errors import DataError
from lmforge.data.records import iter_jsonl
from lmforge.data.sft import checked_messages
from lmforge.data.templates import get_template

_SHUFFLE = 7  # rng_for's purpose id of the prompts' epoch order
# the arguments a reward takes by name beside the records' fields (train/rewards.py)
REWARD_ARGUMENTS = ("prompts", "completions", "completion_ids")


def record_prompt(obj, where: str):
    """A record's prompt: its text, or its checked messages (ending with a user turn)."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: a prompt record is a JSON object with a 'prompt'")
    if "prompt" not in obj:
        raise DataError(f"{where}: the record has no 'prompt'")
    clash = next((k for k in REWARD_ARGUMENTS if k in obj), None)
    if clash is not None:
        raise DataError(f"{where}: the field {clash!r} has the name of an argument every "
                        f"reward takes ({', '.join(REWARD_ARGUMENTS)}); rename it")
    return checked_prompt(obj["prompt"], where)


def checked_prompt(prompt, where: str):
    """A prompt as GRPO and ``lmforge generate --chat`` take it: non-blank text, or chat
    messages (``checked_messages``' roles and order) ending with a user turn."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError(f"{where}: 'prompt' is empty")
        return prompt
    if not isinstance(prompt, list) or not prompt:
        raise DataError(f"{where}: 'prompt' must be a string or a list of messages")
    messages = checked_messages(prompt, where, name=lambda i: f"'prompt' message {i}")
    if messages[-1]["role"] != "user":
        raise DataError(f"{where}: 'prompt' must end with a user message (the completion "
                        f"is the assistant's answer)")
    return messages


def check_prompts(field: str, path, answer_field: Optional[str] = None) -> None:
    """Refuses, before a run writes anything, a prompts file that is missing, holds a bad
    record (file:line) or none, or (``answer_field``: the exact_answer reward's) no
    record with that field."""
    if not Path(path).is_file():
        raise DataError(f"{field}: {path}: no such file (prompts are JSON Lines)")
    count, fields = 0, {}
    for line, obj in iter_jsonl(Path(path)):
        record_prompt(obj, f"{path}:{line}")
        count += 1
        fields.update(dict.fromkeys(k for k in obj if k != "prompt"))
    if not count:
        raise DataError(f"{field}: {path} holds no prompt")
    if answer_field is not None and answer_field not in fields:
        found = ", ".join(show_name(str(k), 20) for k in list(fields)[:8]) or "none"
        raise DataError(f"rl.answer_field: no record of {path} has the field "
                        f"{answer_field!r} that the exact_answer reward reads (its records "
                        f"have: {found}{', ...' if len(fields) > 8 else ''})")


@dataclass
class PromptBatch:
    """A micro-batch of prompts: their token ids, records (the reward functions' fields),
    the ids that end a completion, and the tokenizer that decodes one; ``distinct``: the
    dataset's prompts (a held-out sample id past them is a filler: ``loader.no_targets``)."""
    ids: list[list[int]]
    records: list[dict]
    stop_ids: tuple[int, ...]
    tokenizer: object
    distinct: int = 0


class PromptDataset:
    """The prompts of one file (``part``: all, or data.eval_fraction's train/eval split)."""

    group_size = 0

    def __init__(self, path: str | Path, tokenizer, template: str, max_prompt_tokens: int,
                 seed: int = 0, holdout: Optional[tuple[str, float]] = None):
        self.path, self.seed, self.tokenizer = Path(path), int(seed), tokenizer
        self.template = get_template(template, tokenizer)
        lines = list(iter_jsonl(self.path))
        keep = (np.arange(len(lines)) if holdout is None else
                split_documents(len(lines), holdout[1], holdout[0]))
        self.records, self.ids = [], []
        for k in keep:
            line, obj = lines[k]
            where = f"{self.path}:{line}"
            ids = self._encode(record_prompt(obj, where))
            if len(ids) > max_prompt_tokens:
                raise DataError(f"{where}: the prompt has {len(ids)} tokens; data.seq_len - "
                                f"rl.max_completion_length leaves {max_prompt_tokens}")
            self.records.append(obj)
            self.ids.append(ids)
        if not self.records:
            raise DataError(f"data.path: {self.path}: no prompt"
                            + ("" if holdout is None else f" in its {holdout[0]} part"))
        end = self.template.end_of_turn_id(tokenizer)
        self.stop_ids = tuple(dict.fromkeys([*tokenizer.eos_ids,
                                             *([] if end is None else [end])]))

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        return list(self.template.prompt_ids(prompt, self.tokenizer))

    def __len__(self) -> int:
        return len(self.records)

    @property
    def num_samples(self) -> int:
        return len(self.records)

    @property
    def num_tokens(self) -> int:
        return sum(len(i) for i in self.ids)

    @property
    def distinct_samples(self) -> int:
        return len(self.records)

    def __getitem__(self, k: int) -> int:
        """Stream index k -> the record it reads (a fresh order each epoch)."""
        epoch, i = divmod(int(k), len(self.records))
        return int(rng_for(self.seed, epoch, _SHUFFLE).permutation(len(self.records))[i])

    def batch(self, ks: list[int]) -> dict:
        records = [self[k] for k in ks]
        return {"prompts": PromptBatch([self.ids[r] for r in records],
                                       [self.records[r] for r in records], self.stop_ids,
                                       self.tokenizer, len(self.records)),
                "sample_ids": torch.tensor(ks, dtype=torch.long)}

    def fingerprint(self) -> list:
        return [len(self.records), self.num_tokens]

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
