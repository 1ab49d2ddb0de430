"""``lmforge lora``: merge a PEFT adapter into a Hugging Face model, and evaluate a model
(with or without an adapter) on prompt/response data: response loss and ROUGE-L.

"""
from __future__ import annotations

import json
from pathlib import Path

from lmforge import fsio
from lmforge.cli.common import DEVICES
from lmforge.config import resolve_device
from lmforge.data.tokenizer import load_tokenizer
from lmforge.eval.rouge import evaluate_prompt_response, read_prompt_response
from lmforge.export import EXPORT_DTYPES
from lmforge.models.hf import load_hf_model
from lmforge.peft.adapters import export_merged, load_adapter

_DTYPES = ("auto", *EXPORT_DTYPES)  # auto: the base model's


def add_parser(sub) -> None:
    p = sub.add_parser("lora", help="LoRA adapters: merge into a model, evaluate",
                       description="LoRA / QLoRA adapters in PEFT layout.")
    lsub = p.add_subparsers(metavar="ACTION")

    m = lsub.add_parser("merge", help="merge a PEFT adapter into a Hugging Face model",
                        description="Write a plain Hugging Face model directory with the "
                        "adapter's update added into the weights (loadable by transformers "
                        "and lmforge without peft).")
    m.add_argument("--model", required=True, help="base Hugging Face model directory")
    m.add_argument("--adapter", required=True, help="PEFT adapter directory")
    m.add_argument("--output", required=True, help="output model directory")
    m.add_argument("--dtype", default="auto", choices=_DTYPES,
                   help="stored dtype (auto: the base model's)")
    m.set_defaults(func=_merge)

    e = lsub.add_parser("eval", help="response loss and ROUGE-L on prompt/response JSONL",
                        description="Mean per-token loss over the response tokens and ROUGE-L "
                        "F1 of greedy generations against the responses, for a Hugging Face "
                        "model directory, optionally with a PEFT adapter.")
    e.add_argument("--model", required=True, help="Hugging Face model directory")
    e.add_argument("--adapter", default=None, help="PEFT adapter directory (optional)")
    e.add_argument("--data", required=True, help='JSONL of {"prompt", "response"}')
    e.add_argument("--template", default="auto",
                   help="chat template the model was fine-tuned with (data.template)")
    e.add_argument("--max-new-tokens", type=int, default=64,
                   help="longest generation scored by ROUGE-L")
    e.add_argument("--limit", type=int, default=None, help="score the first N records only")
    e.add_argument("--output", default=None, help="JSON results file (default: "
                   "eval-lora.json in the current directory)")
    e.add_argument("--device", default="auto", choices=DEVICES,
                   help="where to run (auto: a GPU when there is one)")
    e.set_defaults(func=_eval)
    p.set_defaults(func=lambda _: p.print_help() or 2)


def _merge(args) -> int:
    fsio.check_writable(args.output, "--output", kind="dir")  # before the model is read
    model = load_hf_model(args.model)
    load_adapter(model, args.adapter)
    dtype = EXPORT_DTYPES.get(args.dtype)  # None (auto): keep the base model's
    out = export_merged(model, args.output, tokenizer=_tokenizer_or_none(args.model),
                        dtype=dtype)
    print(f"merged {args.adapter} into {args.model}: {out}")
    return 0


def _eval(args) -> int:
    if args.max_new_tokens <= 0 or (args.limit is not None and args.limit <= 0):
        raise ValueError("--max-new-tokens and --limit must be > 0")
    output = Path(args.output or "eval-lora.json")
    fsio.check_writable(output, "--output")  # before the evaluation, not after it
    device = resolve_device(args.device, "--device")
    model = load_hf_model(args.model, device=device).eval()
    if args.adapter:
        load_adapter(model, args.adapter)
        model.to(device)
    tokenizer = load_tokenizer(args.model)
    records = read_prompt_response(args.data, args.limit)
    result = evaluate_prompt_response(model, tokenizer, records, args.template,
                                      args.max_new_tokens)
    result = {"model": str(args.model), "adapter": args.adapter, "data": str(args.data),
              **result}
    print(json.dumps({k: v for k, v in result.items() if k != "examples"}, indent=2))
    for ex in result["examples"][:2]:
        print(f"\nreference:  {ex['reference']}\nprediction: {ex['prediction']}")
    output.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _tokenizer_or_none(model_dir: str):
    if not (Path(model_dir) / "tokenizer.json").is_file():
        return None
    return load_tokenizer(model_dir)
