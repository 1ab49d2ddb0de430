"""Data for the tiny GRPO example (README.md): objects and their true colours.

* ``sft.jsonl``: "What colour is the X?" answered in the right form ("The X is Y.") but
  with a colour drawn at random: supervised fine-tuning teaches the form, not the facts.
* ``prompts.jsonl`` / ``prompts-valid.jsonl``: the questions as GRPO prompts (a user
  message, rendered with the template SFT used), each with
  its ``colour`` field (the true colour), which the reward (``rewards.py``) checks. The
  held-out prompts ask about the same objects in a phrasing training never uses.
* ``corpus.txt``: every text, for the tokenizer.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

COLOURS = ("red", "blue", "green", "yellow", "black", "white", "orange", "purple")
OBJECTS = ("sky", "grass", "snow", "coal", "banana", "lemon", "tomato", "plum", "cherry",
           "ocean", "leaf", "milk", "crow", "carrot", "grape", "pumpkin", "cloud", "frog",
           "ink", "sun", "lime", "violet", "salt", "tar", "ruby", "pea", "swan", "corn")
QUESTIONS = ("What colour is the {}?", "Tell me the colour of the {}.")
HELD_OUT_QUESTION = "Which colour does the {} have?"


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sft", type=int, default=3000)
    p.add_argument("--prompts", type=int, default=1000)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    truth = {obj: rng.choice(COLOURS) for obj in OBJECTS}
    questions = QUESTIONS + (HELD_OUT_QUESTION,)  # (SFT sees every phrasing's form)
    sft = [{"prompt": rng.choice(questions).format(obj), "response": f"The {obj} is {c}."}
           for obj, c in ((rng.choice(OBJECTS), rng.choice(COLOURS)) for _ in range(args.sft))]
    # chat messages: rendered with the template SFT used (a plain string would be
    # tokenized as it is, as TRL does, without the template's markers)
    prompts = [{"prompt": _user(rng.choice(QUESTIONS).format(obj)), "colour": truth[obj]}
               for obj in (rng.choice(OBJECTS) for _ in range(args.prompts))]
    valid = [{"prompt": _user(HELD_OUT_QUESTION.format(obj)), "colour": truth[obj]}
             for obj in OBJECTS]
    files = {"sft.jsonl": sft, "prompts.jsonl": prompts, "prompts-valid.jsonl": valid}
    texts = []
    for name, records in files.items():
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in records))
        texts += [v if isinstance(v, str) else v[0]["content"] for r in records
                  for v in r.values()]
    (out / "corpus.txt").write_text("\n".join(texts) + "\n")
    print(f"wrote {', '.join(f'{len(r)} {n}' for n, r in files.items())} to {out}")


if __name__ == "__main__":
    main()
