"""``lmforge export``: a training checkpoint to Hugging Face / PEFT / merged."""
from __future__ import annotations

from lmforge.export import EXPORT_DTYPES, FORMATS, export_checkpoint


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "export", help="export a checkpoint to Hugging Face / PEFT format",
        description="Convert a training checkpoint (a checkpoints/step-NNNNNNN directory, "
        "or a run directory: its newest checkpoint) to a Hugging Face model directory "
        "(hf), a PEFT adapter (peft) or a model with LoRA merged in (merged). Runs "
        "offline in one process, whatever the layout the checkpoint was saved on.")
    p.add_argument("checkpoint_dir", metavar="CHECKPOINT_DIR",
                   help="checkpoints/step-NNNNNNN, or a run directory (its newest)")
    p.add_argument("out_dir", metavar="OUT_DIR", help="directory to write")
    p.add_argument("--format", dest="fmt", choices=FORMATS, default="hf",
                   help="hf: the whole model; peft: the LoRA adapter only; merged: the model "
                   "with the adapter added into its weights")
    p.add_argument("--tokenizer", metavar="DIR", default=None,
                   help="tokenizer directory (default: the run's tokenizer/)")
    p.add_argument("--dtype", choices=tuple(EXPORT_DTYPES), default=None,
                   help="weight dtype of the export (default: as trained)")
    p.set_defaults(func=_export_command)


def _export_command(args) -> int:
    out = export_checkpoint(args.checkpoint_dir, args.out_dir, fmt=args.fmt,
                            tokenizer_dir=args.tokenizer, dtype=args.dtype)
    print(f"exported {args.fmt}: {out}")
    return 0
