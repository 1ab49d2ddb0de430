"""Preference pairs for the tests: a tiny ChatML model directory (tokenizer with its chat
template in tokenizer_config.json) and JSON Lines of pairs whose chosen answer follows a
rule the model can learn (it repeats the prompt's first word) and whose rejected one
does not."""
from __future__ import annotations

import json
import random
from pathlib import Path

from helpers.real_tokenizers import save_model

WORDS = ("the sky is blue and the ground below is green while rivers run to the sea what "
         "is up say hi hello there be brief").split()


def pairs(n: int, seed: int = 0) -> list[dict]:
    """``n`` records in TRL's three formats, in turn."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 7))]
        prompt = " ".join(words)
        chosen = " ".join([words[0]] * rng.randint(2, 4))
        rejected = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 5)))
        if rejected == chosen:
            rejected += " no"
        out.append(_format(i % 3, prompt, chosen, rejected))
    return out


def _format(kind: int, prompt: str, chosen: str, rejected: str) -> dict:
    user = {"role": "user", "content": prompt}
    if kind == 0:
        return {"prompt": prompt, "chosen": chosen, "rejected": rejected}
    if kind == 1:
        return {"prompt": [user], "chosen": [{"role": "assistant", "content": chosen}],
                "rejected": [{"role": "assistant", "content": rejected}]}
    return {"chosen": [user, {"role": "assistant", "content": chosen}],
            "rejected": [user, {"role": "assistant", "content": rejected}]}


def write_pairs(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def model_dir(root: Path, kind: str = "chatml") -> Path:
    """A tiny random Llama (transformers-built) with its tokenizer and chat template:
    ChatML (tied, one kv head), or llama3 (untied, kv heads that tp=2 divides)."""
    return save_model(kind, root / f"model-{kind}")
