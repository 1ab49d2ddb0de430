"""Data for the end-to-end deploy example (README.md): objects and their colours.

* ``corpus.txt``: "What colour is the X?" then "The X is Y." with a colour drawn at
  random, for the tokenizer and the base model's pretraining (it learns the form, not
  the facts);
* ``chat.jsonl``: the same question answered with the object's true colour (SFT data);
* ``tasks/colours.yaml`` + ``tasks/colours.jsonl``: an lm-eval multiple-choice task with
  local data (one question per object, the eight colours as choices), scored before and
  after fine-tuning.
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
TASK = """task: colours
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "What colour is the {{{{object}}}}?\\nThe {{{{object}}}} is"
doc_to_choice: {choices}
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--texts", type=int, default=3000, help="random-colour statements")
    p.add_argument("--chats", type=int, default=2000, help="true-colour conversations")
    args = p.parse_args()
    out = Path(args.out)
    (out / "tasks").mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    truth = {obj: rng.choice(COLOURS) for obj in OBJECTS}
    texts = []
    for _ in range(args.texts):
        obj = rng.choice(OBJECTS)
        texts.append(f"What colour is the {obj}?\nThe {obj} is {rng.choice(COLOURS)}.")
    (out / "corpus.txt").write_text("\n\n".join(texts) + "\n")
    chats = [{"prompt": f"What colour is the {obj}?", "response": f"The {obj} is {truth[obj]}."}
             for obj in (rng.choice(OBJECTS) for _ in range(args.chats))]
    (out / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    rows = [{"object": obj, "answer": COLOURS.index(truth[obj])} for obj in OBJECTS]
    data = (out / "tasks" / "colours.jsonl").resolve()
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    choices = json.dumps([f"{c}." for c in COLOURS])  # (lm-eval puts a space before each)
    (out / "tasks" / "colours.yaml").write_text(TASK.format(data=data, choices=choices))
    print(f"wrote {len(texts)} statements, {len(chats)} conversations and a "
          f"{len(rows)}-question task to {out}")


if __name__ == "__main__":
    main()
