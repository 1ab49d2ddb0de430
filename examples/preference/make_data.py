"""Data for the tiny preference example (README.md): objects and their true colours.

* ``sft.jsonl``: "What colour is the X?" answered in the right form ("The X is Y.") but
  with a colour drawn at random: supervised fine-tuning teaches the form, not the facts.
* ``pairs.jsonl`` / ``pairs-valid.jsonl``: preference pairs in TRL's plain format, the
  chosen answer naming the object's true colour, the rejected one another colour. The
  held-out pairs ask about the same objects with other rejected colours.
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
QUESTIONS = ("What colour is the {}?", "Tell me the colour of the {}.",
             "Which colour does the {} have?")


def truths(seed: int) -> dict[str, str]:
    rng = random.Random(seed)
    return {obj: rng.choice(COLOURS) for obj in OBJECTS}


def answer(obj: str, colour: str) -> str:
    return f"The {obj} is {colour}."


def pair(rng: random.Random, truth: dict[str, str]) -> dict:
    obj = rng.choice(OBJECTS)
    wrong = rng.choice([c for c in COLOURS if c != truth[obj]])
    return {"prompt": rng.choice(QUESTIONS).format(obj), "chosen": answer(obj, truth[obj]),
            "rejected": answer(obj, wrong)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sft", type=int, default=3000)
    p.add_argument("--pairs", type=int, default=2000)
    p.add_argument("--valid", type=int, default=200)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng, truth = random.Random(args.seed), truths(args.seed)
    sft = [{"prompt": rng.choice(QUESTIONS).format(obj), "response": answer(obj, colour)}
           for obj, colour in ((rng.choice(OBJECTS), rng.choice(COLOURS))
                               for _ in range(args.sft))]
    files = {"sft.jsonl": sft, "pairs.jsonl": [pair(rng, truth) for _ in range(args.pairs)],
             "pairs-valid.jsonl": [pair(rng, truth) for _ in range(args.valid)]}
    texts = []
    for name, records in files.items():
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in records))
        texts += [v for r in records for v in r.values()]
    (out / "corpus.txt").write_text("\n".join(texts) + "\n")
    print(f"wrote {', '.join(f'{len(r)} {n}' for n, r in files.items())} to {out}")


if __name__ == "__main__":
    main()
