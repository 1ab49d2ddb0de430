"""The example's reward, a user function with TRL's signature (rl.rewards=
examples/rl/rewards.py:true_colour): 1.0 when the answer names the record's true colour
and no other, 0.0 otherwise. The prompts are chat messages, so each completion comes as
TRL passes it: a list holding the assistant's message."""
from __future__ import annotations

COLOURS = ("red", "blue", "green", "yellow", "black", "white", "orange", "purple")


def true_colour(prompts, completions, colour, **kwargs):
    out = []
    for completion, want in zip(completions, colour):
        text = completion[0]["content"] if isinstance(completion, list) else completion
        named = {c for c in COLOURS if c in text.lower().replace(".", " ").split()}
        out.append(float(named == {want}))
    return out
