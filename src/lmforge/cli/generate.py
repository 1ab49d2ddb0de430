"""``lmforge generate``: one --prompt printed, or a --prompts JSONL file decoded in
batches into an --output JSONL file (models/generate.py's batched decoder)."""
from __future__ import annotations

import json
import os
from pathlib import Path

from lmforge import fsio
from lmforge.cli.common import DEVICES, INTERRUPTED, note
from lmforge.config import resolve_device
from lmforge.data.errors import DataError
from lmforge.data.prompts import checked_prompt
from lmforge.data.records import check_argument_text
from lmforge.data.sft import iter_jsonl
from lmforge.data.templates import JinjaTemplate
from lmforge.data.tokenizer import chat_template_origin, check_fits_vocabulary, load_tokenizer
from lmforge.export import EXPORT_DTYPES
from lmforge.models.generate import (Sampling, check_cache_fits, check_sampling,
                                     compiled_shapes, generate, generate_in_batches,
                                     packed_for_decode)
from lmforge.models.hf import load_hf_model, stop_token_ids
from lmforge.models.sampling import MIN_TEMPERATURE, check_seed
from lmforge.peft import load_adapter, merge_lora

DEFAULT_NEW_TOKENS = 64
DEFAULT_TEMPERATURE, DEFAULT_TOP_K = 0.8, 50
# --output is written after every GROUP_BATCHES batches: a kill loses at most that many,
# and the prompts of a group are decoded longest first (little padding per batch).
GROUP_BATCHES = 8
ADDED_FIELDS = ("completion", "completion_ids", "finish_reason")  # what --output adds
_OPTIONS = {"max_new_tokens": "--max-new-tokens", "temperature": "--temperature",
            "top_k": "--top-k", "top_p": "--top-p", "min_p": "--min-p"}


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a model",
                       description="Generate a continuation of --prompt, or of every record "
                       "of --prompts (JSONL, in batches, into --output), with the batched "
                       "decoder (docs/generation.md). Prompts are tokenized as the model's "
                       "tokenizer does (its own special tokens); generation stops on "
                       "generation_config.json's eos_token_id.")
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--adapter", default=None,
                   help="PEFT LoRA adapter directory to apply to --model (checked as "
                        "`lmforge lora merge` checks it, then merged into the weights)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="text to continue (or, with --chat, the user "
                        "message); the continuation is printed")
    source.add_argument("--prompts", metavar="FILE.jsonl",
                        help="one JSON object per line with a 'prompt': text, or with "
                        "--chat text or a list of chat messages; needs --output")
    p.add_argument("--output", metavar="FILE.jsonl",
                   help="with --prompts: each input record, in order, plus 'completion' "
                        "(text), 'completion_ids' and 'finish_reason' (stop or length); a "
                        "record that already has one of these is refused. Written every "
                        f"{GROUP_BATCHES} batches, so an interrupted run keeps the records "
                        "it finished, in order (docs/generation.md); its directory must "
                        "exist")
    p.add_argument("--batch-size", type=int, default=8,
                   help="prompts decoded together (with --prompts)")
    p.add_argument("--chat", action="store_true",
                   help="send each prompt through the model's chat template (with the "
                        "generation prompt), keep the reply only, and stop at the "
                        "template's end-of-turn token")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help=f"stop after this many new tokens; prompt + these must fit the "
                        f"model's context (default: {DEFAULT_NEW_TOKENS}, or what the "
                        f"context leaves after a prompt)")
    p.add_argument("--greedy", action="store_true",
                   help="argmax decoding (default: sample); refused with a sampling option")
    p.add_argument("--temperature", type=float, default=None,
                   help=f"sampling temperature: 0 (greedy) or >= {MIN_TEMPERATURE}, the "
                        f"floor (lower: closer to greedy; default: {DEFAULT_TEMPERATURE})")
    p.add_argument("--top-k", type=int, default=None,
                   help=f"sample among the K most likely tokens (0: all; default: "
                        f"{DEFAULT_TOP_K})")
    p.add_argument("--top-p", type=float, default=None,
                   help="sample among the most likely tokens whose probabilities sum to P, "
                   "0 < P <= 1 (default: off)")
    p.add_argument("--min-p", type=float, default=None,
                   help="sample among tokens at least P times as likely as the likeliest, "
                   "0 <= P <= 1 (default: off)")
    p.add_argument("--seed", type=int, default=0,
                   help="sampling seed, 0 to 2**63 - 1 (record i of --prompts samples with "
                        "seed + i)")
    p.add_argument("--compile", action="store_true",
                   help="compile the one-token decode step (CUDA graphs on a GPU); pays "
                        "off on long or many generations")
    p.add_argument("--device", default="auto", choices=DEVICES,
                   help="where to run (auto: a GPU when there is one)")
    p.add_argument("--dtype", default="auto", choices=("auto", *EXPORT_DTYPES),
                   help="the weights' dtype while decoding (auto: as --model stores them); "
                        "on the CPU fp32 decodes fastest (its weights are read packed)")
    p.set_defaults(func=_generate)


def _generate(args) -> int:
    sampling = _check_options(args)
    records = _read_records(args.prompts, args.chat) if args.prompts else None
    device = resolve_device(args.device, "--device")
    model, tokenizer, template, stops = _load(args, device)
    if records is None:
        prompts, wheres = [_encode(args.prompt, template, tokenizer)], [None]
    else:
        prompts = [_encode(r["prompt"], template, tokenizer, where) for where, r in records]
        wheres = [w for w, _ in records]
    _check_lengths(prompts, wheres, args.max_new_tokens, model.args.max_seq_len)
    max_new = args.max_new_tokens or DEFAULT_NEW_TOKENS  # (the decoder keeps to the context)
    if args.adapter:
        load_adapter(model, args.adapter)
        merge_lora(model)  # decodes as fast as the base; equal to `lmforge lora merge`'s model
        model.to(device)
    code = 0
    if records is None:
        new = generate(model, prompts, max_new, sampling, stops, args.seed,
                       compile=args.compile)[0].ids
        reply = tokenizer.decode(new)
        print(reply if args.chat else args.prompt + reply)
    else:  # (a cache no batch can hold is refused before --output is touched)
        check_cache_fits(model, min(args.batch_size, len(prompts)),
                         min(max(map(len, prompts)) + max_new, model.args.max_seq_len), device)
        code = _write_in_groups(args, [r for _, r in records], prompts, model, tokenizer,
                                (max_new, sampling, stops))
    if args.compile:
        note(f"generate: the decode step compiled for {compiled_shapes()} shape(s)")
    return code


def _load(args, device):
    """(model, tokenizer, chat template or None, stop ids) of --model; a tokenizer or a
    stop id past the weights' vocabulary is refused."""
    model = load_hf_model(args.model, device=device, dtype=EXPORT_DTYPES.get(args.dtype))
    tokenizer = load_tokenizer(args.model)
    check_fits_vocabulary(tokenizer, model.args.vocab_size, args.model)
    stops = stop_token_ids(args.model, model.args.vocab_size) or tokenizer.eos_ids
    template = _chat_template(args, tokenizer) if args.chat else None
    if template is not None:
        stops = stops + [template.end_of_turn_id(tokenizer)]
    return model, tokenizer, template, stops


def _check_options(args) -> Sampling:
    """Every option's refusal, before any file is read or the model loaded."""
    temperature, top_k = _sampling_values(args)
    check_sampling(args.max_new_tokens, temperature, top_k, args.top_p, _OPTIONS,
                   min_p=args.min_p)
    check_seed(args.seed, "--seed")
    if args.prompts is None and args.output is not None:
        raise ValueError("--output: goes with --prompts (a single --prompt is printed)")
    if args.prompt is not None:
        check_argument_text(args.prompt, "--prompt")
    if args.prompts is not None:
        if args.output is None:
            raise ValueError("--prompts: needs --output FILE.jsonl to write the completions to")
        if args.batch_size < 1:
            raise ValueError(f"--batch-size: {args.batch_size} must be >= 1")
        _check_output(args)
    if args.greedy:
        return Sampling()
    return Sampling(temperature, top_k, 1.0 if args.top_p is None else args.top_p,
                    args.min_p or 0.0)


def _sampling_values(args) -> tuple[float, int]:
    """(temperature, top-k) to sample with; --greedy with any sampling option is refused:
    one of the two would be ignored."""
    given = [(option, value) for option, value in (
        ("--temperature", args.temperature), ("--top-k", args.top_k),
        ("--top-p", args.top_p), ("--min-p", args.min_p)) if value is not None]
    if args.greedy and given:
        option, value = given[0]
        raise ValueError(f"--greedy contradicts {option} {value} (greedy decoding takes the "
                         f"likeliest token; drop one)")
    temperature = DEFAULT_TEMPERATURE if args.temperature is None else args.temperature
    return temperature, DEFAULT_TOP_K if args.top_k is None else args.top_k


def _check_output(args) -> None:
    """--output names a file whose directory exists, which is none of the inputs."""
    if args.output.endswith(("/", os.sep)):
        raise ValueError(f"{args.output}: --output ends in '/': name the file to write")
    parent = Path(args.output).parent
    if not parent.exists():
        raise FileNotFoundError(f"{args.output}: --output: the directory {parent} does not "
                                f"exist (create it first)")
    fsio.check_writable(args.output, "--output")
    fsio.check_apart(args.output, "--output", [("--prompts", args.prompts),
                                               ("--model", args.model),
                                               ("--adapter", args.adapter)])


def _read_records(path: str, chat: bool) -> list[tuple[str, dict]]:
    """(file:line, record) of each line of --prompts: each holds a 'prompt' (text; with
    --chat text or messages, checked as GRPO's prompts are) and none of the fields
    --output adds."""
    if not Path(path).exists():
        raise FileNotFoundError(f"{path}: --prompts: no such file")
    if not Path(path).is_file():  # (a FIFO would block the read)
        raise ValueError(f"{path}: --prompts is not a regular file")
    records = []
    for line, record in iter_jsonl(Path(path)):
        where = f"{path}:{line}"
        if not isinstance(record, dict) or "prompt" not in record:
            raise DataError(f"{where}: a record needs a 'prompt' (text, or chat messages "
                            "with --chat)")
        if chat:
            checked_prompt(record["prompt"], where)
        elif not isinstance(record["prompt"], str):
            raise DataError(f"{where}: 'prompt' must be text (chat messages need --chat)")
        taken = [name for name in ADDED_FIELDS if name in record]
        if taken:
            raise DataError(f"{where}: the record already has {', '.join(map(repr, taken))}, "
                            f"which --output adds (rename it: a record's own fields are "
                            f"never replaced)")
        records.append((where, record))
    if not records:
        raise DataError(f"{path}: --prompts holds no record (one JSON object with a "
                        "'prompt' per line)")
    return records


def _chat_template(args, tokenizer) -> JinjaTemplate:
    if not tokenizer.chat_template:
        raise ValueError(f"--chat: {args.model} has no chat template (chat_template in "
                         "tokenizer_config.json, or chat_template.jinja)")
    return JinjaTemplate(tokenizer.chat_template, label=chat_template_origin(args.model))


def _encode(prompt, template, tokenizer, where: str = "--prompt") -> list[int]:
    """A prompt's ids: text as the tokenizer encodes it; with --chat, text as the user's
    message or a list of messages (checked by ``_read_records``), rendered with the
    generation prompt."""
    if template is None:
        ids = tokenizer.encode(prompt)
    else:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        ids = template.prompt_ids(messages, tokenizer)
    if not ids:
        raise DataError(f"{where}: the prompt encodes to no tokens")
    return ids


def _check_lengths(prompts, wheres, max_new: int, context: int) -> None:
    """Refuse a prompt the context cannot hold, then one it cannot hold with the
    --max-new-tokens given (the first is the prompt's fault, the second the option's)."""
    places = [f"{w}: " if w else "--prompt: " for w in wheres]
    for ids, place in zip(prompts, places):
        if len(ids) >= context:
            raise DataError(f"{place}the prompt has {len(ids)} tokens; the model's context "
                            f"holds {context} with the new ones (shorten the prompt)")
    for ids, place in zip(prompts, places):
        if max_new is not None and len(ids) + max_new > context:
            raise ValueError(f"--max-new-tokens: {max_new} after the {len(ids)}-token prompt "
                             f"of {place.rstrip(': ')} passes the model's context of "
                             f"{context}; lower it to {context - len(ids)}")


def _write_in_groups(args, records: list[dict], prompts, model, tokenizer, how) -> int:
    """Decode --prompts GROUP_BATCHES batches at a time, in the input's order, appending
    each group's records to --output once it is decoded (``fsio.growing_file``: --output
    is replaced when the first group is in, and holds every finished record from then on).
    Record i samples with seed + i, as one call over all of them would. Ctrl-C ends the
    command (INTERRUPTED) with the records finished so far kept."""
    max_new, sampling, stops = how
    group, total, written = args.batch_size * GROUP_BATCHES, len(prompts), 0
    with fsio.growing_file(args.output) as out, \
            packed_for_decode(model, min(args.batch_size, total), args.compile):
        try:  # (the weights packed once for every group)
            for first in range(0, total, group):
                done = generate_in_batches(
                    model, prompts[first:first + group], max_new, args.batch_size, sampling,
                    stops, args.seed + first, compile=args.compile,
                    progress=_progress_after(first, total) if total > args.batch_size
                    else None)
                out.append(_lines(records[first:first + group], done, tokenizer))
                written += len(done)
        except KeyboardInterrupt:
            note(f"lmforge: interrupted: {args.output} holds the first {written} of "
                 f"{total} records" if written else
                 f"lmforge: interrupted before the first records: {args.output} is as it was")
            return INTERRUPTED
    return 0


def _lines(records: list[dict], done, tokenizer) -> bytes:
    lines = []
    for record, c in zip(records, done):
        out = {**record, "completion": tokenizer.decode(c.ids), "completion_ids": c.ids,
               "finish_reason": c.finish_reason}
        lines.append(json.dumps(out, ensure_ascii=False) + "\n")
    return "".join(lines).encode("utf-8")


def _progress_after(first: int, total: int):
    """The progress of a group whose first record is record ``first``, over all records."""
    return lambda done, _, tokens_per_s: _progress(first + done, total, tokens_per_s)


def _progress(done: int, total: int, tokens_per_s: float) -> None:
    note(f"generate: {done}/{total} prompts, {tokens_per_s:,.0f} new tokens/s")
