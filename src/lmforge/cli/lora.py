"""``lmforge lora merge``: a PEFT adapter merged into a Hugging Face model (or one GGUF
file, ``--format gguf``); ``lora eval``
is an alias of ``lmforge eval-sft`` (which scores any model, adapter or not)."""
from __future__ import annotations

from pathlib import Path

from lmforge import fsio
from lmforge.cli import eval_sft
from lmforge.data.tokenizer import load_tokenizer
from lmforge.export import EXPORT_DTYPES
from lmforge.export.gguf import GGUF_DTYPES, export_gguf_merged
from lmforge.models.hf import load_hf_model
from lmforge.peft.adapters import export_merged, load_adapter

_DTYPES = ("auto", *EXPORT_DTYPES)  # auto: the base model's


def add_parser(sub) -> None:
    p = sub.add_parser("lora", help="LoRA adapters: merge into a model",
                       description="LoRA / QLoRA adapters in PEFT layout.")
    lsub = p.add_subparsers(metavar="ACTION")

    m = lsub.add_parser("merge", help="merge a PEFT adapter into a Hugging Face model",
                        description="Write a plain Hugging Face model directory with the "
                        "adapter's update added into the weights (loadable by transformers "
                        "and lmforge without peft).")
    m.add_argument("--model", required=True, help="base Hugging Face model directory")
    m.add_argument("--adapter", required=True, help="PEFT adapter directory")
    m.add_argument("--output", required=True,
                   help="output model directory (--format gguf: the GGUF file)")
    m.add_argument("--format", dest="fmt", choices=("hf", "gguf"), default="hf",
                   help="hf: a Hugging Face model directory; gguf: one file for llama.cpp "
                   "and Ollama (the base's tokenizer and chat template in it)")
    m.add_argument("--dtype", default=None, choices=_DTYPES,
                   help="hf: stored dtype (default auto: the base model's)")
    m.add_argument("--gguf-dtype", choices=GGUF_DTYPES, default=None,
                   help="gguf: the matrices' type (vectors stay f32; default f16)")
    m.set_defaults(func=_merge)

    eval_sft.add_arguments(lsub.add_parser("eval", help="alias of lmforge eval-sft",
                                           description=eval_sft.DESCRIPTION))
    p.set_defaults(func=lambda _: p.print_help() or 2)


def _merge(args) -> int:
    # an option the other format reads is refused, not ignored
    for option, value, fmt in (("--dtype", args.dtype, "hf"),
                               ("--gguf-dtype", args.gguf_dtype, "gguf")):
        if value is not None and args.fmt != fmt:
            raise ValueError(f"{option}: --format {args.fmt} does not read it (it applies "
                             f"to --format {fmt})")
    args.dtype, args.gguf_dtype = args.dtype or "auto", args.gguf_dtype or "f16"
    fsio.check_apart(args.output, "--output", [("--model", args.model),
                                               ("--adapter", args.adapter)])
    if args.fmt == "gguf":
        out = export_gguf_merged(args.model, args.adapter, args.output, args.gguf_dtype)
        print(f"merged {args.adapter} into {args.model}: {out} (GGUF, {args.gguf_dtype})")
        return 0
    fsio.check_writable(args.output, "--output", kind="dir")  # before the model is read
    model = load_hf_model(args.model)
    load_adapter(model, args.adapter)
    dtype = EXPORT_DTYPES.get(args.dtype)  # None (auto): keep the base model's
    out = export_merged(model, args.output, tokenizer=_tokenizer_or_none(args.model),
                        dtype=dtype)
    print(f"merged {args.adapter} into {args.model}: {out}")
    return 0


def _tokenizer_or_none(model_dir: str):
    if not (Path(model_dir) / "tokenizer.json").is_file():
        return None
    return load_tokenizer(model_dir)
