"""lm-evaluation-harness (``lm-eval``, an optional dependency imported here only) scoring an
lmforge model: ``LmforgeLM`` answers the harness's requests with lmforge's own model
(and adapter) and tokenizer, so a benchmark scores what lmforge trained, not a
reconversion; ``run_harness`` runs tasks offline.

Requests are tokenized as the harness's Hugging Face backend does (by the tokenizer's own
rules, so a Llama tokenizer's BOS comes first; a context's trailing spaces move to the
continuation; an empty context starts from the BOS token, else EOS; a sequence longer
than the model's positions keeps its end), so the two backends score the same ids.

No network: the Hugging Face hub and datasets run offline, switched so before lm-eval
imports them (not one request is made). ``check_tasks`` loads each task as a run would,
before the model loads or the training starts: a task whose data is not on this machine
is refused, saying how to point its YAML at local files, and so is one with no documents
or that lm-eval cannot load, in one line naming the task.
"""
from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.data.tokenizer import Tokenizer
from lmforge.models.generate import generate_in_batches


def local_data_hint(include_field: str = "--include-path") -> str:
    return ("point the task's YAML at local files (dataset_path: json, dataset_kwargs: "
            f"{{data_files: {{test: /path/test.jsonl}}}}) and give its folder as "
            f"{include_field}")


def offline() -> None:
    """The hub and datasets read only what is on this machine: no request is made, not
    even the download counter ``datasets`` pings for a local JSON file."""
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ[name] = "1"
    # Each library reads its switch once, at import: one imported before this call (by
    # another command in the same process, or a test) needs its copy set too.
    hub = sys.modules.get("huggingface_hub.constants")
    if hub is not None:
        hub.HF_HUB_OFFLINE = True
    data = sys.modules.get("datasets.config")
    if data is not None:
        data.HF_HUB_OFFLINE = data.HF_DATASETS_OFFLINE = True


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
                num_fewshot: Optional[int] = None, batch_size: int = 8,
                manager=None) -> dict:
    """The harness's results for ``tasks`` ({task: {metric: value}}), with the number of
    samples scored per task; ``manager``: ``check_tasks``'s, when the caller checked."""
    manager = manager or task_manager(tasks, include_path)
    from lm_eval import simple_evaluate  # optional: lm-evaluation-harness (after offline())

    try:
        results = simple_evaluate(model=harness_model(model, tokenizer, device, batch_size),
                                  tasks=tasks, num_fewshot=num_fewshot, limit=limit,
                                  task_manager=manager, bootstrap_iters=0,
                                  log_samples=False)
    except (ConnectionError, OSError, StopIteration) as e:  # its data went since the check
        raise ValueError(f"--tasks: a task's data is not on this machine ({_one_line(e)}); "
                         f"{local_data_hint()}") from None
    return {"results": results["results"], "n_samples": results.get("n-samples", {}),
            "versions": results.get("versions", {})}


def task_manager(tasks: list[str], include_path: Optional[str | Path] = None,
                 fields: tuple[str, str] = ("--tasks", "--include-path")):
    """lm-eval's task registry (with ``include_path``'s YAMLs), offline, refusing a task
    name it lacks; ``fields`` name the options in the messages."""
    offline()  # before lm-eval imports datasets and huggingface_hub
    try:
        from lm_eval.tasks import TaskManager  # optional: lm-evaluation-harness
    except ImportError:
        raise ValueError(f"{fields[0]}: lm-evaluation-harness is not installed "
                         f"(pip install lm-eval)") from None
    manager = None
    if include_path:  # lm-eval's own ~15,000 task YAMLs take seconds to index: tasks of
        # the folder alone (no group or tag, which may name lm-eval's tasks) do without
        local = TaskManager(include_path=str(include_path), include_defaults=False)
        manager = local if set(tasks) <= set(local.all_subtasks) else None
    manager = manager or TaskManager(include_path=str(include_path) if include_path else None)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ValueError(f"{fields[0]}: {', '.join(unknown)}: no such task in lm-eval or in "
                         f"{fields[1]}")
    return manager


def check_tasks(tasks: list[str], include_path: Optional[str | Path] = None,
                fields: tuple[str, str] = ("--tasks", "--include-path")):
    """``task_manager``, and each task loaded as a run would load it: its data read from
    this machine and holding documents to score (a missing or empty file is refused here,
    not after hours of training). Returns the manager."""
    manager = task_manager(tasks, include_path, fields)
    for name in tasks:
        for leaf, docs in _documents(name, manager, fields):
            if docs == 0:
                part = "its data" if leaf == name else f"its task {leaf}'s data"
                raise ValueError(f"{fields[0]}: {name}: {part} has no documents to score")
    return manager


def _documents(name: str, manager, fields: tuple[str, str]) -> list[tuple[str, int]]:
    """(task, number of documents it scores) for task or group ``name``, loaded as a run
    loads it; a load that fails is one line naming the task."""
    try:
        with _quiet_datasets():  # (a refusal is one line: no "Generating split" bar)
            return [(leaf, len(task.eval_docs)) for leaf, task in _load(name, manager)]
    except StopIteration:  # what datasets raises for an empty JSON file
        return [(name, 0)]
    except (ConnectionError, OSError) as e:
        raise ValueError(f"{fields[0]}: {name}: its data is not on this machine "
                         f"({_one_line(e)}); {local_data_hint(fields[1])}") from None
    except Exception as e:  # the task's YAML is the user's: any fault in it is theirs
        cause = f": {_one_line(e.__cause__)}" if e.__cause__ is not None else ""
        raise ValueError(f"{fields[0]}: {name}: lm-eval cannot load it "
                         f"({type(e).__name__}: {_one_line(e)}{cause})") from None


def _load(name: str, manager) -> list:
    """(name, Task) for each task of task or group ``name``: lm-eval's ``TaskManager.load``
    (the pinned version's), else ``get_task_dict``'s nesting (older ones), flattened."""
    if hasattr(manager, "load"):
        return list(manager.load([name])["tasks"].items())
    from lm_eval.tasks import get_task_dict  # optional: lm-evaluation-harness

    return list(_leaf_tasks(get_task_dict([name], manager)))


@contextlib.contextmanager
def _quiet_datasets():
    """datasets' progress bars (where the environment does not choose) and its logged
    errors (a traceback of the file it failed to read) off for the block: the refusal
    that follows says it in one line."""
    # (datasets: lm-eval's dependency, imported by it already)
    from datasets.utils import (are_progress_bars_disabled, disable_progress_bars,
                                enable_progress_bars, logging)

    switch = "HF_DATASETS_DISABLE_PROGRESS_BARS" not in os.environ \
        and not are_progress_bars_disabled()
    if switch:
        disable_progress_bars()
    verbosity = logging.get_verbosity()
    logging.set_verbosity(logging.CRITICAL)
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        if switch:
            enable_progress_bars()


def _leaf_tasks(loaded: dict):
    """(name, Task) for each task in ``get_task_dict``'s nesting (groups hold dicts)."""
    for key, value in loaded.items():
        if isinstance(value, dict):
            yield from _leaf_tasks(value)
        else:
            yield str(key), value


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
