"""``lmforge export``: a training checkpoint to Hugging Face / PEFT / merged."""
from __future__ import annotations

from pathlib import Path

from lmforge import fsio
from lmforge.checkpoint.directory import find_checkpoint
from lmforge.export import EXPORT_DTYPES, FORMATS, export_checkpoint
from lmforge.export.gguf import GGUF_DTYPES, export_gguf_from, export_gguf_lora_from


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "export", help="export a checkpoint to Hugging Face / PEFT format",
        description="Convert a training checkpoint (a checkpoints/step-NNNNNNN directory, "
        "or a run directory: its newest checkpoint) to a Hugging Face model directory "
        "(hf), a PEFT adapter (peft), a model with LoRA merged in (merged), or one GGUF "
        "file for llama.cpp and Ollama (gguf; from a Hugging Face model directory too). "
        "Runs offline in one process, whatever the layout the checkpoint was saved on.")
    p.add_argument("checkpoint_dir", metavar="CHECKPOINT_DIR",
                   help="checkpoints/step-NNNNNNN, or a run directory (its newest); with "
                   "--format gguf also a Hugging Face model directory")
    p.add_argument("out_dir", metavar="OUT", help="directory to write (gguf: the file)")
    p.add_argument("--format", dest="fmt", choices=(*FORMATS, "gguf", "gguf-lora"),
                   default="hf",
                   help="hf: the whole model; peft: the LoRA adapter only; merged: the model "
                   "with the adapter added into its weights; gguf: one file for llama.cpp "
                   "(LoRA merged in); gguf-lora: the adapter as llama.cpp loads it beside "
                   "its base's GGUF (SOURCE: a run, checkpoint or PEFT adapter directory)")
    p.add_argument("--base", metavar="DIR", default=None,
                   help="gguf-lora: the base model directory (default: the adapter's "
                   "base_model_name_or_path)")
    p.add_argument("--gguf-dtype", choices=GGUF_DTYPES, default=None,
                   help="gguf, gguf-lora: the matrices' type (vectors stay f32; default "
                   "f16)")
    p.add_argument("--tokenizer", metavar="DIR", default=None,
                   help="tokenizer directory of a checkpoint's export (default: the run's "
                   "tokenizer/; not gguf-lora, nor gguf from a model directory)")
    p.add_argument("--dtype", choices=tuple(EXPORT_DTYPES), default=None,
                   help="hf, peft, merged: weight dtype of the export (default: as "
                   "trained; gguf: --gguf-dtype)")
    p.set_defaults(func=_export_command)


def _export_command(args) -> int:
    _refuse_unread_options(args)
    args.gguf_dtype = args.gguf_dtype or "f16"
    fsio.check_apart(args.out_dir, "OUT", _export_inputs(args))  # before anything is read
    if args.fmt == "gguf-lora":
        out = export_gguf_lora_from(args.checkpoint_dir, args.out_dir, args.base,
                                    args.gguf_dtype)
        print(f"exported gguf-lora ({args.gguf_dtype}): {out}")
        return 0
    if args.fmt == "gguf":
        out = export_gguf_from(args.checkpoint_dir, args.out_dir, args.gguf_dtype,
                               args.tokenizer)
        print(f"exported gguf ({args.gguf_dtype}): {out}")
        return 0
    out = export_checkpoint(args.checkpoint_dir, args.out_dir, fmt=args.fmt,
                            tokenizer_dir=args.tokenizer, dtype=args.dtype)
    print(f"exported {args.fmt}: {out}")
    return 0


def _export_inputs(args) -> list:
    """What the export reads, for ``fsio.check_apart``: CHECKPOINT_DIR when it is a
    model or adapter directory; for a run or a checkpoint, the run's checkpoints root and
    its tokenizer/ (OUT may be beside them in the run, as RUN/model.gguf is); --tokenizer,
    --base."""
    source = Path(args.checkpoint_dir)
    inputs = [("--tokenizer", args.tokenizer), ("--base", args.base)]
    if any((source / name).is_file() for name in ("config.json", "adapter_config.json")):
        return [("CHECKPOINT_DIR", source), *inputs]
    try:
        step = find_checkpoint(source)
    except ValueError:
        return inputs  # the export refuses CHECKPOINT_DIR itself, in its own words
    root = step.parent if step.parent.name == "checkpoints" else step
    run_tokenizer = root.parent / "tokenizer" if root is not step else None
    return [("CHECKPOINT_DIR", root), ("CHECKPOINT_DIR", run_tokenizer), *inputs]


def _refuse_unread_options(args) -> None:
    """An option the chosen format would ignore is refused, naming it: a GGUF's type is
    --gguf-dtype, a model directory's GGUF holds that directory's own tokenizer, a LoRA
    GGUF none, and only gguf-lora reads --base."""
    gguf = args.fmt in ("gguf", "gguf-lora")
    if gguf and args.dtype is not None:
        raise ValueError(f"--dtype: --format {args.fmt} does not read it (the GGUF's "
                         f"matrices' type is --gguf-dtype)")
    if not gguf and args.gguf_dtype is not None:
        raise ValueError(f"--gguf-dtype: --format {args.fmt} does not read it (it applies "
                         f"to --format gguf and gguf-lora; {args.fmt}: --dtype)")
    if args.base is not None and args.fmt != "gguf-lora":
        raise ValueError(f"--base: --format {args.fmt} does not read it (it applies to "
                         f"--format gguf-lora)")
    model_dir = (Path(args.checkpoint_dir) / "config.json").is_file()
    if args.tokenizer is not None and (args.fmt == "gguf-lora" or args.fmt == "gguf"
                                       and model_dir):
        why = ("a LoRA GGUF holds no tokenizer" if args.fmt == "gguf-lora" else
               "the GGUF of a model directory holds that directory's own tokenizer")
        raise ValueError(f"--tokenizer: --format {args.fmt} does not read it here ({why})")
