"""``lmforge generate``."""
from __future__ import annotations

import torch

from lmforge.cli.common import DEVICES
from lmforge.config import resolve_device
from lmforge.data.templates import JinjaTemplate
from lmforge.data.tokenizer import chat_template_origin, load_tokenizer
from lmforge.models.generate import check_sampling, generate
from lmforge.models.hf import load_hf_model, stop_token_ids
from lmforge.peft import load_adapter, merge_lora

_OPTIONS = {"max_new_tokens": "--max-new-tokens", "temperature": "--temperature",
            "top_k": "--top-k", "top_p": "--top-p"}


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a model",
                       description="Generate a continuation of --prompt with a KV cache. The "
                       "prompt is tokenized as the model's tokenizer does (its own special "
                       "tokens); generation stops on generation_config.json's eos_token_id.")
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--adapter", default=None,
                   help="PEFT LoRA adapter directory to apply to --model (checked as "
                        "`lmforge lora merge` checks it, then merged into the weights)")
    p.add_argument("--prompt", required=True, help="text to continue (or, with --chat, the "
                   "user message)")
    p.add_argument("--chat", action="store_true",
                   help="send --prompt as a user message through the model's chat template "
                        "(with the generation prompt), print the reply only, and stop at the "
                        "template's end-of-turn token")
    p.add_argument("--max-new-tokens", type=int, default=64,
                   help="stop after this many new tokens")
    p.add_argument("--greedy", action="store_true", help="argmax decoding (default: sample)")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="sampling temperature, >= 0 (lower: closer to greedy; 0: greedy)")
    p.add_argument("--top-k", type=int, default=50,
                   help="sample among the K most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=None,
                   help="sample among the most likely tokens whose probabilities sum to P, "
                   "0 < P <= 1 (default: off)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--device", default="auto", choices=DEVICES,
                   help="where to run (auto: a GPU when there is one)")
    p.set_defaults(func=_generate)


def _generate(args) -> int:
    check_sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p, _OPTIONS)
    device = resolve_device(args.device, "--device")
    model = load_hf_model(args.model, device=device)
    tokenizer = load_tokenizer(args.model)
    prompt, stops = _prompt(args, tokenizer)
    if args.adapter:
        load_adapter(model, args.adapter)
        merge_lora(model)  # decodes as fast as the base; equal to `lmforge lora merge`'s model
        model.to(device)
    new = generate(model, prompt, args.max_new_tokens, greedy=args.greedy,
                   temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                   stop_ids=tuple(stops), generator=torch.Generator().manual_seed(args.seed))
    reply = tokenizer.decode(new)
    print(reply if args.chat else args.prompt + reply)
    return 0


def _prompt(args, tokenizer) -> tuple[list[int], list[int]]:
    """The prompt's token ids and the ids generation stops on."""
    stops = stop_token_ids(args.model) or tokenizer.eos_ids
    if not args.chat:
        return tokenizer.encode(args.prompt), stops
    if not tokenizer.chat_template:
        raise ValueError(f"--chat: {args.model} has no chat template (chat_template in "
                         "tokenizer_config.json, or chat_template.jinja)")
    template = JinjaTemplate(tokenizer.chat_template, label=chat_template_origin(args.model))
    prompt = template.prompt_ids([{"role": "user", "content": args.prompt}], tokenizer)
    return prompt, stops + [template.end_of_turn_id(tokenizer)]
