"""Tokenizers (and tiny models) in the shapes real checkpoints ship, built with
``tokenizers`` and saved as a Hugging Face model directory would hold them:

* ``llama2``: SentencePiece-style (Metaspace) BPE whose post-processor adds ``<s>``;
  ``[INST]`` chat template with ``<s>`` per turn and ``</s>`` after each answer.
* ``llama3``: byte-level BPE whose post-processor adds ``<|begin_of_text|>``; header
  chat template ending each message with ``<|eot_id|>``.
* ``chatml``: byte-level BPE that adds nothing; ``bos_token`` is ``<|im_start|>`` (as in
  SmolLM), ``eos_token`` is ``<|endoftext|>``, and replies end with ``<|im_end|>``.

The chat templates live in tokenizer_config.json (or, with ``jinja_file=True``, in
chat_template.jinja, the other place transformers reads).
"""
from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

KINDS = ("llama2", "llama3", "chatml")

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{- message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")

LLAMA2_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system = messages[0]['content'] %}{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system = none %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('roles must alternate user/assistant') }}{%- endif %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if loop.index0 == 0 and system %}"
    "{%- set text = '<<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{%- else %}{%- set text = message['content'] %}{%- endif %}"
    "{{- bos_token + '[INST] ' + text | trim + ' [/INST]' }}"
    "{%- else %}{{- ' ' + message['content'] | trim + ' ' + eos_token }}{%- endif %}"
    "{%- endfor %}")

TEMPLATES = {"llama2": LLAMA2_TEMPLATE, "llama3": LLAMA3_TEMPLATE, "chatml": CHATML_TEMPLATE}

_WORDS = ("the sky is blue and the ground below is green while rivers run to the sea "
          "what is up say hi hello there be brief a question answer system user assistant "
          "tell me about tokens models and data INST SYS").split()


def corpus(n: int = 400, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 16))) +
            rng.choice([".", "?", "!", "\n", ":"]) for _ in range(n)]


def build_tokenizer(kind: str) -> tuple[Tokenizer, dict]:
    """(tokenizer.json content, tokenizer_config.json content) of one kind."""
    texts = corpus() + ["[INST] <<SYS>>\n<</SYS>>\n\n [/INST]"] * 20
    if kind == "llama2":
        specials = ["<unk>", "<s>", "</s>"]
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581",
                                                     prepend_scheme="first")
        tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                      min_frequency=2, show_progress=False)
    else:
        specials = (["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                     "<|end_header_id|>", "<|eot_id|>"] if kind == "llama3" else
                    ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=specials, min_frequency=2,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    bos, eos = {"llama2": ("<s>", "</s>"), "llama3": ("<|begin_of_text|>", "<|end_of_text|>"),
                "chatml": ("<|im_start|>", "<|endoftext|>")}[kind]
    if kind == "chatml":  # adds nothing: its bos_token is never put in front of a text
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    else:
        template = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tok.token_to_id(bos))])
        tok.post_processor = template if kind == "llama2" else processors.Sequence(
            [processors.ByteLevel(trim_offsets=False), template])
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos,
              "eos_token": eos, "clean_up_tokenization_spaces": False,
              "model_max_length": 4096}
    return tok, config


def save_tokenizer(kind: str, out: Path, template: str | None = "default",
                   jinja_file: bool = False) -> Path:
    """Writes tokenizer.json + tokenizer_config.json (+ chat template) into ``out``."""
    tok, config = build_tokenizer(kind)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    template = TEMPLATES[kind] if template == "default" else template
    if template and jinja_file:
        (out / "chat_template.jinja").write_text(template)
    elif template:
        config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return out


def save_model(kind: str, out: Path, seed: int = 0) -> Path:
    """A tiny random transformers Llama with this kind's tokenizer: a model directory.
    The shapes vary by kind as real checkpoints do (tied or not, GQA, rope_theta)."""
    import transformers

    from helpers.hf_models import random_hf_llama

    save_tokenizer(kind, out)
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    shape = {"llama2": dict(tie_word_embeddings=False, num_key_value_heads=4),
             "llama3": dict(tie_word_embeddings=False, rope_theta=500000.0),
             "chatml": dict(tie_word_embeddings=True, rope_theta=100000.0,
                        num_key_value_heads=1)}[kind]
    model = random_hf_llama(seed, vocab_size=len(hf_tok), bos_token_id=hf_tok.bos_token_id,
                            eos_token_id=hf_tok.eos_token_id, **shape)
    model.save_pretrained(out)
    return out
