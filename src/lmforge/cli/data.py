"""``lmforge preprocess`` and ``lmforge tokenizer``: raw text to tokens."""
from __future__ import annotations

import itertools
import sys
from pathlib import Path

from lmforge import fsio
from lmforge.data.preprocess import preprocess
from lmforge.data.tokenizer import (CORPUS_SUFFIXES, iter_text_files, train_bpe,
                                    training_texts)

JSON_KEY = "text"  # the field holding a record's text, unless --json-key says otherwise
PREPROCESS_DESCRIPTION = ("Tokenize raw text (.jsonl, .jsonl.gz, .json, .txt, .parquet) into "
                          "a Megatron-LM indexed dataset, PREFIX.bin/.idx.")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "preprocess", help="tokenize raw text into a Megatron indexed dataset (.bin/.idx)",
        description=PREPROCESS_DESCRIPTION)
    _preprocess_arguments(p)
    p.set_defaults(func=_preprocess)
    _add_tokenizer(sub)


def _preprocess_arguments(p) -> None:
    p.add_argument("--input", nargs="+", required=True, metavar="PATH",
                   help="files or directories of .jsonl, .jsonl.gz, .json (array), .txt "
                        "(one document per file), .parquet")
    p.add_argument("--output-prefix", required=True, metavar="PREFIX",
                   help="writes PREFIX.bin/.idx (one key) or PREFIX_{key}_document.bin/.idx")
    p.add_argument("--tokenizer", required=True, metavar="DIR",
                   help="directory with tokenizer.json")
    p.add_argument("--json-key", nargs="+", action="extend", metavar="KEY",
                   help="JSON/parquet field(s) holding the text; one output per key "
                        f"(default: {JSON_KEY})")
    p.add_argument("--append-eod", action="store_true",
                   help="end every document with the tokenizer's end-of-text token")
    p.add_argument("--special-tokens", choices=("tokenizer", "none"), default="tokenizer",
                   help="tokenizer (default): keep the special tokens the tokenizer adds to "
                        "a text (BOS for Llama-2/3), as Megatron-LM does; none: the text's "
                        "tokens only")
    p.add_argument("--workers", type=int, default=1, metavar="N",
                   help="tokenizer processes; memory ~ N x --chunk-mb")
    p.add_argument("--chunk-mb", type=float, default=1.0, metavar="MB",
                   help="input read and tokenized per task")
    p.add_argument("--on-error", choices=("stop", "skip"), default="stop",
                   help="bad records (not JSON, missing key, not UTF-8): stop with "
                        "file:line (default) or skip them and report where")
    bar = p.add_mutually_exclusive_group()
    bar.add_argument("--progress", dest="progress", action="store_true", default=None,
                     help="progress bar on stderr (default: when stderr is a terminal)")
    bar.add_argument("--no-progress", dest="progress", action="store_false",
                     help="no progress bar")


def _preprocess(args) -> int:
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    stats = preprocess(args.input, args.output_prefix, args.tokenizer,
                       tuple(args.json_key or [JSON_KEY]), args.append_eod, args.workers,
                       args.on_error, args.chunk_mb, progress, args.special_tokens)
    print(stats.summary(), flush=True)
    return 0


def _add_tokenizer(sub) -> None:
    p = sub.add_parser("tokenizer", help="tokenizer tools",
                       description="Tokenizer tools.")
    tsub = p.add_subparsers(metavar="ACTION")
    t = tsub.add_parser("train", help="train a byte-level BPE tokenizer on local files",
                        description="Train a byte-level BPE tokenizer on local files (or "
                        "directories of them) and save tokenizer.json. JSON Lines, JSON "
                        "arrays and parquet give the text under --json-key of each record; "
                        "other files their whole text.")
    t.add_argument("--input", required=True, nargs="+", metavar="PATH",
                   help=f"files, or directories of {', '.join(CORPUS_SUFFIXES)}")
    t.add_argument("--json-key", nargs="+", action="extend", metavar="KEY",
                   help="JSON/parquet field(s) holding the text, all trained on "
                        f"(default: {JSON_KEY})")
    t.add_argument("--vocab-size", type=int, required=True,
                   help="tokens in the vocabulary, the 256 bytes and 3 special tokens included")
    t.add_argument("--output", required=True, help="output directory")
    t.set_defaults(func=_tokenizer_train)
    p.set_defaults(func=lambda _: p.print_help() or 2)


def _tokenizer_train(args) -> int:
    if args.vocab_size < 260:
        raise ValueError("--vocab-size must be at least 260 (256 bytes + special tokens)")
    fsio.check_apart(args.output, "--output", [("--input", i) for i in args.input])
    fsio.check_writable(args.output, "--output", kind="dir")
    files = list(iter_text_files(args.input, CORPUS_SUFFIXES))
    if not files:
        raise ValueError(f"{', '.join(args.input)}: no "
                         f"{'/'.join(CORPUS_SUFFIXES)} files found")
    texts = training_texts(files, args.json_key or [JSON_KEY])
    first = next(texts, None)  # a tokenizer of no text would be the 256 bytes alone
    if first is None:
        raise ValueError(f"--input {' '.join(args.input)}: no text to train a tokenizer on "
                         f"(every file, or every record's text, is empty)")
    tokenizer = train_bpe(itertools.chain([first], texts), args.vocab_size)
    tokenizer.save(args.output)
    print(f"trained a {tokenizer.vocab_size}-token BPE tokenizer on {len(files)} files: "
          f"{Path(args.output) / 'tokenizer.json'}")
    return 0
