"""``lmforge eval-sft``: a model (with or without a PEFT adapter) scored on prompt/response
data: the response tokens' mean loss and ROUGE-L of greedy generations. ``lmforge lora
eval`` is its earlier name, kept as an alias."""
from __future__ import annotations

import json
from pathlib import Path

from lmforge import fsio
from lmforge.cli.common import DEVICES, load_scored_model
from lmforge.config import resolve_device
from lmforge.data.tokenizer import load_tokenizer
from lmforge.eval.rouge import evaluate_prompt_response, read_prompt_response

HELP = "response loss and ROUGE-L of a model (+ adapter) on prompt/response JSONL"
DESCRIPTION = ("Mean per-token loss over the response tokens and ROUGE-L F1 of greedy "
               "generations against the responses, for a Hugging Face model directory, "
               "optionally with a PEFT adapter.")


def add_parser(sub) -> None:
    add_arguments(sub.add_parser("eval-sft", help=HELP, description=DESCRIPTION))


def add_arguments(e) -> None:
    e.add_argument("--model", required=True, help="Hugging Face model directory")
    e.add_argument("--adapter", default=None, help="PEFT adapter directory (optional)")
    e.add_argument("--data", required=True, help='JSONL of {"prompt", "response"}')
    e.add_argument("--template", default="auto",
                   help="chat template the model was fine-tuned with (data.template)")
    e.add_argument("--max-new-tokens", type=int, default=64,
                   help="longest generation scored by ROUGE-L")
    e.add_argument("--limit", type=int, default=None, help="score the first N records only")
    e.add_argument("--output", default=None, help="JSON results file (default: "
                   "eval-sft.json in the current directory)")
    e.add_argument("--device", default="auto", choices=DEVICES,
                   help="where to run (auto: a GPU when there is one)")
    e.set_defaults(func=evaluate_sft)


def evaluate_sft(args) -> int:
    if args.max_new_tokens <= 0 or (args.limit is not None and args.limit <= 0):
        raise ValueError("--max-new-tokens and --limit must be > 0")
    output = Path(args.output or "eval-sft.json")
    fsio.check_apart(output, "--output", [("--model", args.model),
                                          ("--adapter", args.adapter), ("--data", args.data)])
    fsio.check_writable(output, "--output")  # before the evaluation, not after it
    device = resolve_device(args.device, "--device")
    model = load_scored_model(args.model, args.adapter, device)
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
