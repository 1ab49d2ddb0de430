"""The end-of-run sample, and which prompt it continues.

``train.sample_prompt`` when set (the demo's is ``"def "``, for its code corpus). When it
is null, the default of a run with ``model.init_from`` (config/defaults.py), the prompt
comes from the held-out data: for SFT the first sample of ``data.eval_path`` (else the
first one ``data.eval_fraction`` holds out of ``data.path``) up to its first answer,
rendered as the chat template renders a prompt for generation (as
``lmforge generate --chat`` does); for text and pretraining data the first tokens of the
first held-out row evaluation reads (for text files: the start of the first held-out
document). With no held-out data there is no sample, and the run says why in one line.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import torch

from lmforge.config import JobConfig
from lmforge.data.build import DataBundle
from lmforge.data.errors import DataError
from lmforge.data.sft import held_out_records, iter_jsonl, record_messages
from lmforge.data.templates import get_template
from lmforge.data.tokenizer import Tokenizer
from lmforge.models.generate import Sampling, generate

PREFIX_TOKENS = 16  # of a held-out document: enough to set the topic, short to print
TEMPERATURE, TOP_K = 0.8, 50


@dataclass
class SamplePrompt:
    ids: list[int]  # what generation continues
    text: str  # the prompt as printed before the continuation
    source: str  # where it came from, for the printed line
    stop_ids: tuple[int, ...] = ()  # besides EOS: the chat template's end of turn


def choose_sample_prompt(cfg: JobConfig, tokenizer: Tokenizer,
                         data: DataBundle) -> Union[SamplePrompt, str]:
    """The prompt of the sample, or the one-line reason there is none."""
    if cfg.train.sample_prompt is not None:
        return SamplePrompt(tokenizer.encode(cfg.train.sample_prompt),
                            cfg.train.sample_prompt, "train.sample_prompt")
    if cfg.data.kind == "sft":
        return _sft_prompt(cfg, tokenizer, data)
    return _held_out_prefix(tokenizer, data)


def _sft_prompt(cfg: JobConfig, tokenizer: Tokenizer,
                data: DataBundle) -> Union[SamplePrompt, str]:
    path, held_out = cfg.data.eval_path, False
    if not path and data.eval_batches is not None:  # data.eval_fraction held samples out
        path, held_out = cfg.data.path, True
    path = path[0] if isinstance(path, (list, tuple)) and path else path
    if not path:
        return ("no held-out samples (data.eval_path, data.eval_fraction) to take a prompt "
                "from; set train.sample_prompt")
    try:
        records = (held_out_records(Path(path), cfg.data.eval_fraction) if held_out
                   else iter_jsonl(Path(path)))
        line, record = next(records, (None, None))
        if record is None:
            return f"{path} holds no sample to take a prompt from"
        messages = record_messages(record, f"{path}:{line}")
        template = get_template(cfg.data.template, tokenizer)
        first_answer = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
        ids = template.prompt_ids(messages[:first_answer], tokenizer)
        stop = template.end_of_turn_id(tokenizer)
    except (DataError, OSError) as e:
        return f"no prompt from {path} ({e})"
    source = f"the first held-out sample of {path}" if held_out else \
        f"the first sample of {path}"
    return SamplePrompt(ids, tokenizer.decode(ids, skip_special=False), source, (stop,))


def _held_out_prefix(tokenizer: Tokenizer, data: DataBundle) -> Union[SamplePrompt, str]:
    batch = next(iter(data.eval_batches()), None) if data.eval_batches else None
    if batch is None:
        return ("no held-out data (data.eval_path, data.eval_fraction) to take a prompt "
                "from; set train.sample_prompt")
    if "prompts" in batch:  # (data.kind=prompts: the first held-out prompt, whole)
        prompts = batch["prompts"]
        return SamplePrompt(prompts.ids[0], tokenizer.decode(prompts.ids[0], skip_special=False),
                            "the held-out prompts", prompts.stop_ids)
    ids = batch["input_ids"][0, :PREFIX_TOKENS].tolist()
    return SamplePrompt(ids, tokenizer.decode(ids), "the held-out data")


def write_sample(cfg: JobConfig, model: torch.nn.Module, tokenizer: Tokenizer,
                 data: DataBundle, autocast) -> Optional[str]:
    """Prints the prompt and ``train.sample_tokens`` sampled tokens after it (or why
    there is no sample); returns that text, or None."""
    prompt = choose_sample_prompt(cfg, tokenizer, data)
    if isinstance(prompt, str):
        print(f"no sample: {prompt}", flush=True)
        return None
    with autocast():
        room = model.args.max_seq_len - 1  # a long prompt's last tokens, room for one more
        new = generate(model, [prompt.ids[-room:]], cfg.train.sample_tokens,
                       Sampling(temperature=TEMPERATURE, top_k=TOP_K),
                       stop_ids=tuple(tokenizer.eos_ids) + prompt.stop_ids,
                       seeds=cfg.train.seed)[0].ids
    text = prompt.text + tokenizer.decode(new)
    print(f"sample ({cfg.train.sample_tokens} tokens, temperature {TEMPERATURE}, prompt "
          f"from {prompt.source}):\n{text}", flush=True)
    return text
