"""lm-evaluation-harness (``lm-eval``, an optional dependency imported here only) scoring an
lmforge model: ``LmforgeLM`` answers the harness's requests with lmforge's own model
(and adapter) and tokenizer, so a benchmark scores what lmforge trained, not a
reconversion; ``run_harness`` runs tasks offline.

Requests are tokenized as the harness's Hugging Face backend does (by the tokenizer's own
rules, so a Llama tokenizer's BOS comes first; a context's trailing spaces move to the
continuation; an empty context starts from the BOS token, else EOS; a sequence longer
than the model's positions keeps its end), so the two backends score the same ids.

No network: the Hugging Face hub and datasets run offline. A task whose data is not on
this machine is refused, saying how to point its YAML at local files.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.data.tokenizer import Tokenizer
from lmforge.models.generate import generate_in_batches

LOCAL_DATA_HINT = ("point the task's YAML at local files (dataset_path: json, "
                   "dataset_kwargs: {data_files: {test: /path/test.jsonl}}) and give its "
                   "folder as --include-path")


def offline() -> None:
    """The hub and datasets read only what is on this machine."""
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ[name] = "1"


def harness_model(model: nn.Module, tokenizer: Tokenizer, device: torch.device,
                  batch_size: int = 8):
    """An ``lm_eval.api.model.LM`` answering with ``model`` (built on first use, so that
    lm-eval is imported only when a benchmark runs)."""
    from lm_eval.api.model import LM  # optional: lm-evaluation-harness (pip install lm-eval)

    class LmforgeLM(LM):
        def loglikelihood(self, requests) -> list[tuple[float, bool]]:
            pairs = [_encode_pair(tokenizer, *r.args) for r in requests]
            return _score(model, pairs, device, batch_size, model.args.max_seq_len)

        def loglikelihood_rolling(self, requests) -> list[float]:
            from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

            out = []
            for request in requests:
                ids = tokenizer.encode(request.args[0])
                windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                    ids, _prefix(tokenizer), model.args.max_seq_len, 1)]
                out.append(sum(lp for lp, _ in _score(model, windows, device, batch_size,
                                                      model.args.max_seq_len)))
            return out

        def generate_until(self, requests) -> list[str]:
            return _generate_until(model, tokenizer, [r.args for r in requests], batch_size)

    return LmforgeLM()


def _prefix(tok: Tokenizer) -> int:
    return tok.bos_id if tok.bos_id is not None else tok.eos_id


def _encode_pair(tok: Tokenizer, context: str, continuation: str
                 ) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as the harness's HF backend makes them."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    if not context:
        return [_prefix(tok)], tok.encode(continuation)
    whole = tok.encode(context + continuation)
    context_ids = tok.encode(context)
    return context_ids, whole[len(context_ids):]


@torch.no_grad()
def _score(model: nn.Module, pairs: list[tuple[list[int], list[int]]], device,
           batch_size: int, max_len: int) -> list[tuple[float, bool]]:
    """(sum of the continuation's log-probabilities, whether greedy decoding gives it)
    per pair, ``batch_size`` sequences at a time, each right-padded to the batch's
    longest (causal attention: the padding changes nothing before it)."""
    model.eval()
    out = []
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start:start + batch_size]
        seqs = [(c + x)[-(max_len + 1):] for c, x in chunk]
        width = max(len(s) for s in seqs) - 1
        tokens = torch.zeros(len(seqs), width, dtype=torch.long)
        for row, s in enumerate(seqs):
            tokens[row, :len(s) - 1] = torch.tensor(s[:-1])
        logprobs = F.log_softmax(model(tokens.to(device)).float(), dim=-1).cpu()
        for row, (s, (_, continuation)) in enumerate(zip(seqs, chunk)):
            n = len(continuation)
            positions = range(len(s) - 1 - n, len(s) - 1)
            target = torch.tensor(s[-n:])
            lp = logprobs[row, list(positions)]
            total = float(lp.gather(-1, target[:, None]).sum())
            out.append((total, bool((lp.argmax(-1) == target).all())))
    return out


def _generate_until(model: nn.Module, tok: Tokenizer, requests: list, batch_size: int
                    ) -> list[str]:
    """Greedy continuations of each (context, kwargs), in batches (the batched decoder),
    each cut at the first of its ``until``."""
    prompts, limits, untils = [], [], []
    for context, kwargs in requests:
        until = kwargs.get("until") or []
        untils.append([until] if isinstance(until, str) else list(until))
        ids = tok.encode(context) or [_prefix(tok)]
        prompts.append(ids[-(model.args.max_seq_len - 1):])
        limits.append(int(kwargs.get("max_gen_toks", 256)))
    done = generate_in_batches(model, prompts, limits, batch_size, stop_ids=tuple(tok.eos_ids))
    out = []
    for c, until in zip(done, untils):
        text = tok.decode(c.ids)
        for stop in until:
            text = text.split(stop)[0]
        out.append(text)
    return out


def run_harness(model: nn.Module, tokenizer: Tokenizer, device, tasks: list[str],
                include_path: Optional[str | Path] = None, limit: Optional[float] = None,
                num_fewshot: Optional[int] = None, batch_size: int = 8) -> dict:
    """The harness's results for ``tasks`` ({task: {metric: value}}), with the number of
    samples scored per task."""
    from lm_eval import simple_evaluate  # optional: lm-evaluation-harness

    manager = check_tasks(tasks, include_path)
    try:
        results = simple_evaluate(model=harness_model(model, tokenizer, device, batch_size),
                                  tasks=tasks, num_fewshot=num_fewshot, limit=limit,
                                  task_manager=manager, bootstrap_iters=0,
                                  log_samples=False)
    except (ConnectionError, FileNotFoundError, OSError) as e:
        raise ValueError(f"--tasks: a task's data is not on this machine ({_one_line(e)}); "
                         f"{LOCAL_DATA_HINT}") from None
    return {"results": results["results"], "n_samples": results.get("n-samples", {}),
            "versions": results.get("versions", {})}


def check_tasks(tasks: list[str], include_path: Optional[str | Path] = None,
                fields: tuple[str, str] = ("--tasks", "--include-path")):
    """lm-eval's task registry (with ``include_path``'s YAMLs), refusing a task it lacks;
    ``fields`` name the options in the messages."""
    offline()
    try:
        from lm_eval.tasks import TaskManager  # optional: lm-evaluation-harness
    except ImportError:
        raise ValueError(f"{fields[0]}: lm-evaluation-harness is not installed "
                         f"(pip install lm-eval)") from None
    manager = TaskManager(include_path=str(include_path) if include_path else None)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ValueError(f"{fields[0]}: {', '.join(unknown)}: no such task in lm-eval or in "
                         f"{fields[1]}")
    return manager


def headline_scores(results: dict) -> dict[str, float]:
    """``run_harness``'s results as flat metrics, ``harness/<task>/<metric>`` (lm-eval's
    unfiltered metrics, "acc,none"; their standard errors, and what is not a metric,
    "alias", "sample_len", left out)."""
    scores = {}
    for task, metrics in results["results"].items():
        for name, value in metrics.items():
            metric, comma, filt = name.partition(",")  # ("acc", ",", "none"); no comma:
            if comma and filt == "none" and not metric.endswith("_stderr") \
                    and isinstance(value, (int, float)) and not isinstance(value, bool):
                scores[f"harness/{task}/{metric}"] = float(value)
    return scores


def _one_line(e: Exception) -> str:
    text = " ".join(str(e).split())
    return text[:200] + ("..." if len(text) > 200 else "")
