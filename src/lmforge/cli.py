"""The ``lmforge`` command: parses arguments and calls the library. Nothing else lives here.

Bad input exits with status 2 and one line saying what is wrong; set LMFORGE_DEBUG=1 for
the full traceback.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

# Errors a user can cause and fix: reported as one line, never as a traceback.
USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, PermissionError)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    try:
        return args.func(args) or 0
    except USER_ERRORS as e:
        return _fail(e, 2)
    except FloatingPointError as e:  # train.on_nonfinite=stop: the run diverged
        return _fail(e, 3)


def _fail(error: Exception, code: int) -> int:
    if os.environ.get("LMFORGE_DEBUG"):
        raise error
    message = " ".join(str(error).split()) or type(error).__name__
    print(f"lmforge: error: {message}", file=sys.stderr)
    return code


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lmforge", description="Pretrain and fine-tune Llama-family models.")
    sub = parser.add_subparsers(metavar="COMMAND")
    _add_train(sub)
    _add_eval(sub)
    _add_generate(sub)
    _add_tokenizer(sub)
    for module in ("lmforge.data.preprocess", "lmforge.checkpoint", "lmforge.estimate",
                   "lmforge.report", "lmforge.launch", "lmforge.peft.cli"):
        _add_optional(sub, module)
    return parser


def _add_optional(sub, module: str) -> None:
    """Subcommands whose modules register themselves (``add_cli(subparsers)``)."""
    import importlib

    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        return
    mod.add_cli(sub)


# ----------------------------------------------------------------------------- train

def _add_train(sub) -> None:
    p = sub.add_parser("train", help="train a model (no config: the embedded CPU demo)",
                       description="Train a Llama. Without CONFIG, runs the embedded demo: a "
                       "tiny Llama trained on the CPU on the Python standard library.")
    p.add_argument("config", nargs="?", help="YAML recipe (see configs/)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="config overrides, e.g. optim.lr=3e-4 train.max_steps=50")
    p.set_defaults(func=_train)


def _train(args) -> int:
    from lmforge.config import load_config
    from lmforge.train.loop import train

    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config and not Path(config).exists():
        config, overrides = None, [config] + overrides  # only overrides were given
    cfg = load_config(config, overrides)
    train(cfg)
    return 0


# ------------------------------------------------------------------------------ eval

def _add_eval(sub) -> None:
    p = sub.add_parser("eval", help="mean per-token loss and perplexity of a model",
                       description="Mean per-token loss and perplexity of a Hugging Face "
                       "model directory on local data (text files, a directory of them, "
                       "JSONL, or a preprocessed PREFIX).")
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--data", required=True, nargs="+", help="text file(s)/dir, .jsonl or PREFIX")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--json-key", default="text",
                   help="JSONL field holding each document's text (default: text)")
    p.add_argument("--output", default=None, help="JSON results file (default: eval.json "
                   "in the current directory)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.set_defaults(func=_eval)


def _eval(args) -> int:
    from lmforge.data.tokenizer import load_tokenizer
    from lmforge.evaluate import eval_batches_for
    from lmforge.models.hf import load_hf_model
    from lmforge.train.step import evaluate

    if args.seq_len <= 0 or args.batch_size <= 0:
        raise ValueError("--seq-len and --batch-size must be > 0")
    device = _device(args.device)
    model = load_hf_model(args.model, device=device)
    tokenizer = load_tokenizer(args.model)
    batches = eval_batches_for(args.data, tokenizer, args.seq_len, args.batch_size,
                               args.json_key)
    loss, tokens = evaluate(model, batches, device)
    result = {"model": str(args.model), "data": [str(d) for d in args.data],
              "seq_len": args.seq_len, "tokens": tokens, "loss": loss,
              "perplexity": math.exp(loss)}
    print(json.dumps(result, indent=2))
    Path(args.output or "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


# -------------------------------------------------------------------------- generate

def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a model",
                       description="Generate a continuation of --prompt with a KV cache. The "
                       "prompt is tokenized as the model's tokenizer does (its own special "
                       "tokens); generation stops on generation_config.json's eos_token_id.")
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true",
                   help="send --prompt as a user message through the model's chat template "
                        "(with the generation prompt), print the reply only, and stop at the "
                        "template's end-of-turn token")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--greedy", action="store_true", help="argmax decoding (default: sample)")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.set_defaults(func=_generate)


def _generate(args) -> int:
    import torch

    from lmforge.data.templates import JinjaTemplate
    from lmforge.data.tokenizer import load_tokenizer
    from lmforge.generate import generate
    from lmforge.models.hf import load_hf_model, stop_token_ids

    if args.max_new_tokens <= 0:
        raise ValueError("--max-new-tokens must be > 0")
    model = load_hf_model(args.model, device=_device(args.device))
    tokenizer = load_tokenizer(args.model)
    stops = stop_token_ids(args.model) or tokenizer.eos_ids
    if args.chat:
        if not tokenizer.chat_template:
            raise ValueError(f"--chat: {args.model} has no chat template (chat_template in "
                             "tokenizer_config.json, or chat_template.jinja)")
        template = JinjaTemplate(tokenizer.chat_template)
        prompt = template.prompt_ids([{"role": "user", "content": args.prompt}], tokenizer)
        stops.append(template.end_of_turn_id(tokenizer))
    else:
        prompt = tokenizer.encode(args.prompt)
    new = generate(model, prompt, args.max_new_tokens, greedy=args.greedy,
                   temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                   stop_ids=tuple(stops), generator=torch.Generator().manual_seed(args.seed))
    reply = tokenizer.decode(new)
    print(reply if args.chat else args.prompt + reply)
    return 0


# ------------------------------------------------------------------------- tokenizer

def _add_tokenizer(sub) -> None:
    p = sub.add_parser("tokenizer", help="tokenizer tools",
                       description="Tokenizer tools.")
    tsub = p.add_subparsers(metavar="ACTION")
    t = tsub.add_parser("train", help="train a byte-level BPE tokenizer on local files",
                        description="Train a byte-level BPE tokenizer on local text files "
                        "(or directories of them) and save tokenizer.json.")
    t.add_argument("--input", required=True, nargs="+", help="files or directories")
    t.add_argument("--vocab-size", type=int, required=True)
    t.add_argument("--output", required=True, help="output directory")
    t.set_defaults(func=_tokenizer_train)
    p.set_defaults(func=lambda _: p.print_help() or 2)


def _tokenizer_train(args) -> int:
    from lmforge.data.tokenizer import iter_text_files, read_text, train_bpe

    if args.vocab_size < 260:
        raise ValueError("--vocab-size must be at least 260 (256 bytes + special tokens)")
    files = list(iter_text_files(args.input))
    if not files:
        raise ValueError(f"{', '.join(args.input)}: no .txt/.md/.py/.rst files found")
    tokenizer = train_bpe((read_text(f) for f in files), args.vocab_size)
    tokenizer.save(args.output)
    print(f"trained a {tokenizer.vocab_size}-token BPE tokenizer on {len(files)} files: "
          f"{Path(args.output) / 'tokenizer.json'}")
    return 0


def _device(name: str):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no GPU is visible")
    return torch.device(name)


if __name__ == "__main__":
    sys.exit(main())
