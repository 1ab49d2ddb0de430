"""``lmforge eval``: loss and perplexity of a model directory on local data.

The result (JSON) goes to stdout, and to a file only with ``--output``; what the command
is doing (loading, evaluating: a bar on a terminal, else a line every
``PROGRESS_EVERY_S`` seconds) goes to stderr, so stdout stays machine-readable."""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

from lmforge import fsio
from lmforge.cli.common import DEVICES, load_scored_model
from lmforge.config import OBJECTIVE_KEYS, PREFERENCE_OBJECTIVES, resolve_device
from lmforge.data.preference import PreferenceDataset
from lmforge.data.tokenizer import load_tokenizer
from lmforge.eval.evaluate import eval_batches_for, evaluate, limit_tokens
from lmforge.eval.preference import evaluate_pairs
from lmforge.models.hf import load_hf_model, read_model_args
from lmforge.models.preference import NEEDS_REFERENCE, PreferenceParams

PROGRESS_EVERY_S = 30.0  # without a terminal: how often a progress line is written


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="mean per-token loss and perplexity of a model",
                       description="Mean per-token loss and perplexity of a Hugging Face "
                       "model directory on local data (text files, a directory of them, "
                       "JSONL, or a preprocessed PREFIX). Prints the result as JSON; "
                       "progress goes to stderr.")
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--data", required=True, nargs="+", help="text file(s)/dir, .jsonl or PREFIX")
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens per window (default: 256, or the model's maximum if shorter)")
    p.add_argument("--batch-size", type=int, default=8, help="windows per forward pass")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="score at most this many tokens, from the start of the data "
                   "(default: all of it)")
    p.add_argument("--json-key", default="text",
                   help="JSONL field holding each document's text (default: text)")
    p.add_argument("--output", default=None,
                   help="also write the JSON result to this file (default: stdout only)")
    p.add_argument("--device", default="auto", choices=DEVICES,
                   help="where to run (auto: a GPU when there is one)")
    pairs = p.add_argument_group(
        "preference pairs", "with --objective, --data is a JSON Lines file of preference "
        "records (as data.kind=preference reads them) and the result is the objective's mean "
        "loss and TRL's metrics (rewards/chosen, rewards/margins, rewards/accuracies, ...)")
    pairs.add_argument("--objective", default=None, choices=PREFERENCE_OBJECTIVES,
                       help="score pairs with this preference loss")
    pairs.add_argument("--adapter", default=None,
                       help="PEFT adapter directory on --model (its base is the reference "
                       "when no --reference is given)")
    pairs.add_argument("--reference", default=None,
                       help="reference model directory (dpo, ipo)")
    pairs.add_argument("--template", default="auto", help="chat template (data.template)")
    pairs.add_argument("--max-prompt-len", type=int, default=None,
                       help="a longer prompt keeps its last tokens (data.max_prompt_len)")
    pairs.add_argument("--beta", type=float, default=0.1, help="train.beta")
    pairs.add_argument("--label-smoothing", type=float, default=0.0,
                       help="train.label_smoothing")
    pairs.add_argument("--simpo-gamma", type=float, default=0.5, help="train.simpo_gamma")
    pairs.add_argument("--orpo-lambda", type=float, default=0.1, help="train.orpo_lambda")
    p.set_defaults(func=_eval)


# Each option of preference pairs: its config key (OBJECTIVE_KEYS says which objectives
# read it; None: every objective) and its default. Set otherwise where nothing reads it,
# it is refused as train refuses the key.
_PAIR_OPTIONS = (("--beta", "train.beta", 0.1),
                 ("--label-smoothing", "train.label_smoothing", 0.0),
                 ("--simpo-gamma", "train.simpo_gamma", 0.5),
                 ("--orpo-lambda", "train.orpo_lambda", 0.1),
                 ("--reference", "train.reference", None), ("--adapter", None, None),
                 ("--template", None, "auto"), ("--max-prompt-len", None, None))


def _refuse_unused_options(args) -> None:
    for option, key, default in _PAIR_OPTIONS:
        users = OBJECTIVE_KEYS[key] if key else PREFERENCE_OBJECTIVES
        given = getattr(args, option[2:].replace("-", "_"))
        if given != default and args.objective not in users:
            who = args.objective or "an evaluation without --objective"
            raise ValueError(f"{option}: {who} does not use it (it applies to --objective "
                             f"{', '.join(users)})")


def _eval(args) -> int:
    _refuse_unused_options(args)
    if (args.seq_len is not None and args.seq_len <= 0) or args.batch_size <= 0:
        raise ValueError("--seq-len and --batch-size must be > 0")
    if args.max_tokens is not None and args.max_tokens <= 0:
        raise ValueError(f"--max-tokens: {args.max_tokens} must be > 0")
    output = Path(args.output) if args.output else None
    if output is not None:
        fsio.check_apart(output, "--output", [
            ("--model", args.model), ("--adapter", args.adapter),
            ("--reference", args.reference), *[("--data", d) for d in _data_files(args.data)]])
        fsio.check_writable(output, "--output")  # before the evaluation, not after it
    seq_len = _seq_len(args.model, args.seq_len)
    device = resolve_device(args.device, "--device")
    if args.objective:
        return _eval_pairs(args, seq_len, device, output)
    tokenizer = load_tokenizer(args.model)  # the data is read (and refused) first
    batches = limit_tokens(eval_batches_for(args.data, tokenizer, seq_len, args.batch_size,
                                            args.json_key), args.max_tokens)
    _status(f"loading {args.model} on {device}")
    model = load_hf_model(args.model, device=device)
    budget = f", at most {args.max_tokens:,} tokens" if args.max_tokens else ""
    _status(f"evaluating on {', '.join(args.data)} (seq_len {seq_len}, batch size "
            f"{args.batch_size}{budget})")
    with EvalProgress(args.max_tokens) as progress:
        loss, tokens = evaluate(model, batches, device, on_batch=progress.update)
    result = {"model": str(args.model), "data": [str(d) for d in args.data],
              "seq_len": seq_len, "tokens": tokens, "loss": loss,
              "perplexity": math.exp(loss)}
    print(json.dumps(result, indent=2))
    if output is not None:
        output.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _eval_pairs(args, seq_len: int, device, output) -> int:
    """``--objective``: the preference loss and TRL's metrics of --model (+ --adapter)
    on the pairs of --data."""
    if len(args.data) != 1:
        raise ValueError("--data: preference pairs come in one .jsonl file")
    if args.beta <= 0 or not 0 <= args.label_smoothing < 0.5:
        raise ValueError("--beta must be > 0 and --label-smoothing in [0, 0.5)")
    if args.objective in NEEDS_REFERENCE and not (args.reference or args.adapter):
        raise ValueError(f"--reference: {args.objective} compares with a reference model: "
                         f"give one, or an --adapter whose base model is the reference")
    tokenizer = load_tokenizer(args.model)  # the pairs are read (and refused) first
    pairs = PreferenceDataset(args.data[0], tokenizer, args.template, seq_len,
                              args.max_prompt_len)
    _status(f"loading {args.model} on {device}")
    model = load_scored_model(args.model, args.adapter, device)
    reference = load_hf_model(args.reference, device=device) if args.reference else None
    rows = pairs.rows.tolist()
    batches = (pairs.pair_batch(rows[i:i + args.batch_size])
               for i in range(0, len(rows), args.batch_size))
    params = PreferenceParams(args.beta, args.label_smoothing, args.simpo_gamma,
                              args.orpo_lambda)
    _status(f"scoring {len(rows):,} pairs of {args.data[0]} with {args.objective}")
    result = {"model": str(args.model), "adapter": args.adapter, "reference": args.reference,
              "data": str(args.data[0]), "objective": args.objective, "seq_len": seq_len,
              **evaluate_pairs(model, batches, device, args.objective, params, reference)}
    print(json.dumps(result, indent=2))
    if output is not None:
        output.write_text(json.dumps(result, indent=2) + "\n")
    return 0


class EvalProgress:
    """Tokens scored and the loss so far: a bar on a terminal, else a line on stderr every
    ``PROGRESS_EVERY_S`` seconds and one at the end."""

    def __init__(self, max_tokens):
        self.started = self.last_line = time.perf_counter()
        self.tokens, self.loss = 0, float("nan")
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm  # only when a bar is shown

            self.bar = tqdm(total=max_tokens, unit="tok", unit_scale=True, file=sys.stderr,
                            desc="eval", dynamic_ncols=True)

    def update(self, tokens: int, loss: float) -> None:
        if self.bar is not None:
            self.bar.update(tokens - self.tokens)
            self.bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        elif time.perf_counter() - self.last_line >= PROGRESS_EVERY_S:
            self._line(tokens, loss)
        self.tokens, self.loss = tokens, loss

    def _line(self, tokens: int, loss: float) -> None:
        self.last_line = time.perf_counter()
        _status(f"eval: {tokens:,} tokens, loss {loss:.4f}, "
                f"{self.last_line - self.started:.0f} s")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()
        elif exc[0] is None and self.tokens:
            self._line(self.tokens, self.loss)


def _status(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _seq_len(model_dir: str, seq_len: int | None) -> int:
    """``--seq-len``, checked against the model's maximum from config.json alone (before
    the weights are read): the model was never trained on positions past it, so a loss
    measured there says nothing about the model."""
    longest = read_model_args(model_dir).max_seq_len
    if seq_len is None:
        return min(256, longest)
    if seq_len > longest:
        raise ValueError(f"--seq-len: {seq_len} is above the model's maximum sequence length "
                         f"{longest} (max_position_embeddings in {Path(model_dir) / 'config.json'})")
    return seq_len


def _data_files(data: list[str]) -> list[str]:
    """--data as read: each path, and an indexed PREFIX's .bin and .idx."""
    return [f for d in data for f in (d, f"{d}.bin", f"{d}.idx")]
