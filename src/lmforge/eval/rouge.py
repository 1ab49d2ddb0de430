"""ROUGE-L (Lin, 2004) and a generate-then-score evaluation for prompt/response data.

ROUGE-L compares a prediction with a reference through their longest common subsequence
(LCS) of words: precision = LCS / prediction length, recall = LCS / reference length,
F1 their harmonic mean. Text is lower-cased and split on anything that is not a letter or
digit (the usual ``rouge_score`` tokenisation, without stemming). A corpus score is the
mean of the per-example F1s.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

import torch

from lmforge.data.records import iter_jsonl
from lmforge.data.templates import get_template
from lmforge.eval.evaluate import evaluate
from lmforge.models.generate import generate_in_batches
from lmforge import IGNORE_INDEX

_WORD = re.compile(r"[a-z0-9]+")


@dataclass(frozen=True)
class RougeScore:
    precision: float
    recall: float
    f1: float


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def lcs_length(a: Sequence[str], b: Sequence[str]) -> int:
    """Length of the longest common subsequence, O(len(a) * len(b)) time, O(len(b)) memory."""
    if len(a) < len(b):
        a, b = b, a
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0]
        for j, y in enumerate(b):
            current.append(previous[j] + 1 if x == y else max(previous[j + 1], current[j]))
        previous = current
    return previous[-1]


def rouge_l(prediction: str, reference: str) -> RougeScore:
    pred, ref = words(prediction), words(reference)
    if not pred or not ref:
        return RougeScore(0.0, 0.0, 0.0)
    lcs = lcs_length(pred, ref)
    if lcs == 0:
        return RougeScore(0.0, 0.0, 0.0)
    p, r = lcs / len(pred), lcs / len(ref)
    return RougeScore(p, r, 2 * p * r / (p + r))


def corpus_rouge_l(predictions: Iterable[str], references: Iterable[str]) -> float:
    """Mean ROUGE-L F1 over aligned pairs."""
    predictions, references = list(predictions), list(references)
    if len(predictions) != len(references):
        raise ValueError(f"rouge: {len(predictions)} predictions for "
                         f"{len(references)} references")
    if not predictions:
        raise ValueError("rouge: nothing to score")
    return sum(rouge_l(p, r).f1 for p, r in zip(predictions, references)) / len(predictions)


# ------------------------------------------------------------- generation + scoring

def read_prompt_response(path: str | Path, limit: Optional[int] = None) -> list[dict]:
    """``{"prompt", "response"}`` records of a JSONL file (the first ``limit``)."""
    records = []
    for line_no, obj in iter_jsonl(Path(path)):  # a bad line is refused with file:line
        if not (isinstance(obj, dict) and isinstance(obj.get("prompt"), str)
                and isinstance(obj.get("response"), str)):
            raise ValueError(f"{path}:{line_no}: expected string 'prompt' and 'response'")
        records.append(obj)
        if limit is not None and len(records) >= limit:
            break
    if not records:
        raise ValueError(f"{path}: no records")
    return records


def prompt_ids(tokenizer, prompt: str, template: str = "auto") -> list[int]:
    """The tokens a model trained with ``data.template`` sees before its answer."""
    return get_template(template, tokenizer).prompt_ids([{"role": "user", "content": prompt}],
                                                        tokenizer)


def answer_ids(tokenizer, prompt: str, response: str, template: str = "auto"
               ) -> tuple[list[int], list[bool]]:
    """(ids, trained flags) of a whole sample, as the SFT pipeline renders it."""
    ids, trained = get_template(template, tokenizer).encode(
        [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}],
        tokenizer)
    return [int(i) for i in ids], [bool(t) for t in trained]


def evaluate_prompt_response(model, tokenizer, records: list[dict], template: str = "auto",
                             max_new_tokens: int = 64, batch_size: int = 8) -> dict:
    """Mean per-token loss over the response tokens (+ end of turn) and ROUGE-L of greedy
    generations against the responses. Returns a dict with ``loss``, ``perplexity``,
    ``rouge_l``, ``tokens``, ``samples`` and the first few ``examples``."""
    device = next(model.parameters()).device
    rows = []
    for r in records:
        ids, trained = answer_ids(tokenizer, r["prompt"], r["response"], template)
        ids = ids[:model.args.max_seq_len + 1]
        labels = [i if t else IGNORE_INDEX for i, t in zip(ids[1:], trained[1:])]
        rows.append((ids[:-1], labels))

    def batches():
        for start in range(0, len(rows), batch_size):
            chunk = rows[start:start + batch_size]
            width = max(len(ids) for ids, _ in chunk)
            pad = tokenizer.pad_id if tokenizer.pad_id is not None else 0
            inputs = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in chunk])
            labels = torch.tensor([lab + [IGNORE_INDEX] * (width - len(lab))
                                   for _, lab in chunk])
            yield {"input_ids": inputs, "labels": labels}

    loss, tokens = evaluate(model, batches(), device)
    stop = get_template(template, tokenizer).end_of_turn_id(tokenizer)
    predictions, examples = [], []
    prompts = [prompt_ids(tokenizer, r["prompt"], template) for r in records]
    room = model.args.max_seq_len - 1  # the prompt's last tokens, leaving room for an answer
    answers = generate_in_batches(model, [p[-room:] for p in prompts], max_new_tokens,
                                  batch_size, stop_ids=(stop,))
    for r, answer in zip(records, answers):
        text = tokenizer.decode([t for t in answer.ids if t != stop]).strip()
        predictions.append(text)
        if len(examples) < 3:
            examples.append({"prompt": r["prompt"], "reference": r["response"],
                             "prediction": text})
    return {"loss": loss, "perplexity": math.exp(loss), "tokens": tokens,
            "rouge_l": corpus_rouge_l(predictions, [r["response"] for r in records]),
            "samples": len(records), "examples": examples}
