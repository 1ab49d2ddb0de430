"""Generate a small dialogue-summarisation dataset (deterministic from --seed).

Short everyday chats between two people (meetings, lending things, errands, running late,
lost items, parties, pick-ups, repairs), each with a one-sentence reference summary that
states the outcome: the agreed day, place, time, thing or number, which sometimes changes
during the chat. Writes, under --out:

  train.jsonl, validation.jsonl   {"prompt": "Dialogue:\\n...\\nSummary:", "response": "..."}
  pretrain/train.txt, pretrain/validation.txt
                                  text to pretrain the tiny base model on: the dialogues
                                  (never followed by their summary) and, separately,
                                  summary-style sentences about other, random events, so
                                  the base knows the words and sentence shapes but not the
                                  task of summarising; the LoRA fine-tune teaches that.

Usage: python examples/dialogsum/make_data.py --out runs/dialogsum/data
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = ["Anna", "Ben", "Carla", "David", "Emma", "Frank", "Grace", "Henry", "Iris", "Jack",
         "Kate", "Leo", "Maria", "Nick", "Olivia", "Paul", "Rosa", "Sam", "Tina", "Victor",
         "Wendy", "Oscar", "Lucy", "Tom"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
TIMES = ["9 am", "10 am", "11 am", "noon", "1 pm", "2 pm", "3 pm", "4 pm", "5 pm", "6 pm",
         "7 pm", "8 pm"]
PLACES = ["library", "cafe", "park", "station", "office", "gym", "cinema", "museum",
          "market", "beach"]
ITEMS = ["bike", "camera", "laptop", "umbrella", "drill", "tent", "guitar", "ladder",
         "projector", "suitcase"]
SHOP_ITEMS = ["apples", "eggs", "batteries", "candles", "lemons", "cups", "envelopes",
              "tomatoes"]
SHOPS = ["supermarket", "bakery", "pharmacy", "corner shop", "hardware store"]
REASONS = ["traffic", "rain", "train delay", "flat tyre", "long meeting", "broken alarm"]
FOODS = ["a cake", "some pizza", "a salad", "cookies", "fresh bread", "fruit juice"]
ROOMS = ["kitchen", "car", "garden", "hallway", "bedroom", "garage"]
REPAIRS = ["heater", "washing machine", "fridge", "printer", "door lock", "shower"]
NUMBERS = ["two", "three", "four", "five", "six", "ten", "twelve"]
MINUTES = ["ten", "fifteen", "twenty", "thirty", "forty"]

GREETINGS = ["Hi {b}!", "Hey {b}, are you there?", "Hello {b}.", "{b}, got a minute?"]
REPLIES = ["Hi {a}, sure.", "Hey {a}! What's up?", "Yes, tell me.", "Hi! Go ahead."]
CLOSINGS = [("Great, thanks!", "See you."), ("Perfect.", "Bye!"), ("Thanks a lot.", "No problem."),
            ("Deal.", "Talk soon.")]


def _chat(rng, a, b, core):
    lines = []
    if rng.random() < 0.8:
        lines += [(a, rng.choice(GREETINGS).format(b=b)), (b, rng.choice(REPLIES).format(a=a))]
    lines += core
    if rng.random() < 0.7:
        x, y = rng.choice(CLOSINGS)
        lines += [(a, x), (b, y)]
    return lines


def meeting(rng, a, b):
    place, day, time = rng.choice(PLACES), rng.choice(DAYS), rng.choice(TIMES)
    core = [(a, f"Shall we meet at the {place} on {day}?")]
    if rng.random() < 0.5:
        new_day = rng.choice([d for d in DAYS if d != day])
        core += [(b, f"{day} is bad for me. What about {new_day}?"), (a, f"{new_day} works.")]
        day = new_day
    else:
        core += [(b, f"Yes, {day} is fine.")]
    core += [(b, "What time?"), (a, f"Let's say {time}."), (b, "OK.")]
    return core, f"{a} and {b} will meet at the {place} on {day} at {time}."


def lend(rng, a, b):
    item, day = rng.choice(ITEMS), rng.choice(DAYS)
    core = [(a, f"Could you lend me your {item}?"), (b, "What do you need it for?"),
            (a, "I need it for a trip this weekend."),
            (b, f"Sure. I can bring the {item} on {day}.")]
    return core, f"{b} will lend {a} the {item} on {day}."


def shopping(rng, a, b):
    n, thing, shop = rng.choice(NUMBERS), rng.choice(SHOP_ITEMS), rng.choice(SHOPS)
    core = [(a, f"Are you going to the {shop} today?"), (b, "Yes, in an hour."),
            (a, f"Can you buy {n} {thing} for me?")]
    if rng.random() < 0.5:
        new_n = rng.choice([x for x in NUMBERS if x != n])
        core += [(a, f"Sorry, make it {new_n} {thing}."), (b, f"OK, {new_n} {thing}.")]
        n = new_n
    else:
        core += [(b, f"No problem, {n} {thing}.")]
    return core, f"{b} will buy {n} {thing} at the {shop} for {a}."


def late(rng, a, b):
    reason, minutes = rng.choice(REASONS), rng.choice(MINUTES)
    core = [(a, "I'm so sorry, I'm running late."), (b, "What happened?"),
            (a, f"The {reason}. I will be there in {minutes} minutes."),
            (b, "Don't worry, I will wait.")]
    return core, f"{a} is running {minutes} minutes late because of the {reason}."


def lost(rng, a, b):
    item, room = rng.choice(ITEMS), rng.choice(ROOMS)
    core = [(a, f"Have you seen my {item}? I can't find it."),
            (b, f"I think I saw it in the {room}."), (a, "Let me check."),
            (a, f"Yes! It was in the {room}.")]
    return core, f"{a} lost the {item} and {b} saw it in the {room}."


def party(rng, a, b):
    day, food = rng.choice(DAYS), rng.choice(FOODS)
    core = [(a, f"I'm having a party on {day}. Do you want to come?"),
            (b, "I'd love to! Should I bring something?"), (a, f"Maybe {food}?"),
            (b, f"OK, I will bring {food}.")]
    return core, f"{a} invited {b} to a party on {day} and {b} will bring {food}."


def pickup(rng, a, b):
    c = rng.choice([n for n in NAMES if n not in (a, b)])
    place, time = rng.choice(PLACES), rng.choice(TIMES)
    core = [(a, f"Can you pick up {c} from the {place}?"), (b, "When?")]
    if rng.random() < 0.5:
        new_time = rng.choice([t for t in TIMES if t != time])
        core += [(a, f"At {time}."), (b, f"I can't at {time}. Is {new_time} OK?"),
                 (a, f"Yes, {new_time} is fine.")]
        time = new_time
    else:
        core += [(a, f"At {time}."), (b, "Sure, I will.")]
    return core, f"{b} will pick up {c} from the {place} at {time}."


def repair(rng, a, b):
    thing, day = rng.choice(REPAIRS), rng.choice(DAYS)
    core = [(a, f"The {thing} is broken again."), (b, "Oh no. Did you call someone?"),
            (a, f"Yes, a technician will come on {day}."), (b, "Good.")]
    return core, f"A technician will repair the {thing} on {day}."


SCENARIOS = [meeting, lend, shopping, late, lost, party, pickup, repair]


def dialogue(rng) -> tuple[str, str]:
    a, b = rng.sample(NAMES, 2)
    core, summary = rng.choice(SCENARIOS)(rng, a, b)
    text = "\n".join(f"{who}: {line}" for who, line in _chat(rng, a, b, core))
    return text, summary


def sample(rng) -> dict:
    text, summary = dialogue(rng)
    return {"prompt": f"Dialogue:\n{text}\nSummary:", "response": summary}


def pretrain_text(rng, n_dialogues: int, n_notes: int) -> str:
    """Dialogues alone, and notes of unrelated summary-style sentences, in random order."""
    docs = [dialogue(rng)[0] for _ in range(n_dialogues)]
    docs += [" ".join(dialogue(rng)[1] for _ in range(rng.randint(2, 4)))
             for _ in range(n_notes)]
    rng.shuffle(docs)
    return "\n\n".join(docs) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/dialogsum/data")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train", type=int, default=3000, help="training dialogue/summary pairs")
    p.add_argument("--validation", type=int, default=200)
    args = p.parse_args(argv)
    out = Path(args.out)
    (out / "pretrain").mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    splits = {"train": [sample(rng) for _ in range(args.train)],
              "validation": [sample(rng) for _ in range(args.validation)]}
    for name, records in splits.items():
        with open(out / f"{name}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    # The base model's text comes from its own random stream: no validation dialogue
    # appears in it (the chance of an exact repeat is negligible but not checked).
    base_rng = random.Random(args.seed + 1)
    (out / "pretrain" / "train.txt").write_text(pretrain_text(base_rng, 4000, 1500))
    (out / "pretrain" / "validation.txt").write_text(pretrain_text(base_rng, 150, 50))
    print(f"wrote {args.train} train and {args.validation} validation pairs, and the "
          f"pretraining text, to {out}")


if __name__ == "__main__":
    main()
