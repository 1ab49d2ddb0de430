"""``lmforge eval``: loss and perplexity of a model directory on local data."""
from __future__ import annotations

import json
import math
from pathlib import Path

from lmforge import fsio
from lmforge.cli.common import DEVICES
from lmforge.config import resolve_device
from lmforge.data.tokenizer import load_tokenizer
from lmforge.eval.evaluate import eval_batches_for, evaluate
from lmforge.models.hf import CONFIG_NAME, args_from_hf_config, load_hf_model, read_hf_config


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="mean per-token loss and perplexity of a model",
                       description="Mean per-token loss and perplexity of a Hugging Face "
                       "model directory on local data (text files, a directory of them, "
                       "JSONL, or a preprocessed PREFIX).")
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--data", required=True, nargs="+", help="text file(s)/dir, .jsonl or PREFIX")
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens per window (default: 256, or the model's maximum if shorter)")
    p.add_argument("--batch-size", type=int, default=8, help="windows per forward pass")
    p.add_argument("--json-key", default="text",
                   help="JSONL field holding each document's text (default: text)")
    p.add_argument("--output", default=None, help="JSON results file (default: eval.json "
                   "in the current directory)")
    p.add_argument("--device", default="auto", choices=DEVICES,
                   help="where to run (auto: a GPU when there is one)")
    p.set_defaults(func=_eval)


def _eval(args) -> int:
    if (args.seq_len is not None and args.seq_len <= 0) or args.batch_size <= 0:
        raise ValueError("--seq-len and --batch-size must be > 0")
    output = Path(args.output or "eval.json")
    fsio.check_writable(output, "--output")  # before the evaluation, not after it
    seq_len = _seq_len(args.model, args.seq_len)
    device = resolve_device(args.device, "--device")
    model = load_hf_model(args.model, device=device)
    tokenizer = load_tokenizer(args.model)
    batches = eval_batches_for(args.data, tokenizer, seq_len, args.batch_size,
                               args.json_key)
    loss, tokens = evaluate(model, batches, device)
    result = {"model": str(args.model), "data": [str(d) for d in args.data],
              "seq_len": seq_len, "tokens": tokens, "loss": loss,
              "perplexity": math.exp(loss)}
    print(json.dumps(result, indent=2))
    output.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _seq_len(model_dir: str, seq_len: int | None) -> int:
    """``--seq-len``, checked against the model's maximum from config.json alone (before
    the weights are read): the model was never trained on positions past it, so a loss
    measured there says nothing about the model."""
    source = Path(model_dir) / CONFIG_NAME
    longest = args_from_hf_config(read_hf_config(model_dir), source=str(source)).max_seq_len
    if seq_len is None:
        return min(256, longest)
    if seq_len > longest:
        raise ValueError(f"--seq-len: {seq_len} is above the model's maximum sequence length "
                         f"{longest} (max_position_embeddings in {source})")
    return seq_len
