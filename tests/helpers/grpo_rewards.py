"""A reward for GRPO's tests (TRL's signature) whose values differ between the
completions of a tiny random model, so that advantages, gradients and clipping are not
all zero: the share of a completion's characters that are vowels."""


def vowels(prompts, completions, **fields):
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [sum(ch in "aeiou" for ch in t) / max(len(t), 1) for t in texts]
