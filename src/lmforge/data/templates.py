"""Chat templates: how a conversation becomes token ids and which of them are trained.

``data.template`` picks one (``get_template``):

* ``auto``    the model's own Jinja chat template (``chat_template`` in
  tokenizer_config.json, or ``chat_template.jinja``) when the tokenizer has one, else
  ``plain``. The default.
* ``chatml``  ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message (Qwen, SmolLM...);
  a built-in Jinja template, so it renders exactly as the model's own would.
* ``plain``   what the tokenizer adds in front of a text (its post-processor's prefix:
  ``<s>`` for Llama-2, nothing for ChatML tokenizers), ``{system}\\n\\n``, then per turn
  ``{user}\\n``, ``{assistant}`` and EOS.
* ``llama2``  ``<s>[INST] <<SYS>>\\n{system}\\n<</SYS>>\\n\\n{user} [/INST] {assistant}</s>``,
  one ``<s>...</s>`` per turn (Meta's format; BOS/EOS are the tokenizer's).
* ``llama3``  ``<|begin_of_text|>`` then per message ``<|start_header_id|>{role}
  <|end_header_id|>\\n\\n{content}<|eot_id|>`` (the tokenizer must have those tokens).
* a format string with ``{prompt}`` then ``{response}``, e.g.
  ``"### Question:\\n{prompt}\\n\\n### Answer:\\n{response}"``, applied to each
  user/assistant pair (a system message goes before the first prompt, ``{system}\\n\\n``)
  and followed by EOS. Plain substitution, no Jinja; other braces are literal.

Only the assistant's content and its end-of-turn token are trained on. The built-in
plain/llama2/llama3/format-string templates render pieces that are tokenized one by one.
A Jinja template renders the whole conversation to text, tokenized at once as
``apply_chat_template(tokenize=True)`` does; the trained characters are found by
rendering the conversation prefix by prefix (each assistant reply starts where the
rendering of the turns before it, with the generation prompt, ends) and run from the
reply's content to the first special token after it (``<|im_end|>``, ``<|eot_id|>``,
``</s>``): a template with none there is refused, as its model could never learn to stop.
Jinja runs sandboxed (``ImmutableSandboxedEnvironment``, as transformers does); template
code comes only from the model's tokenizer files or the built-ins, never from the data.
"""
from __future__ import annotations

import hashlib
import json
from datetime import datetime
from functools import lru_cache
from typing import Optional, Union

import numpy as np

from lmforge.config import CHAT_TEMPLATES
from lmforge.data.errors import DataError

BUILTIN = ("plain", "llama2", "llama3")  # rendered as pieces; the rest of CHAT_TEMPLATES: Jinja
LLAMA3_TOKENS = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
CHATML = ("{% for message in messages %}"
          "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

Piece = Union[str, int]  # text to tokenize, or a token id
Sample = tuple[np.ndarray, np.ndarray]  # (token ids, trained flags)


def get_template(name: str, tok) -> "ChatTemplate | JinjaTemplate":
    """The template ``data.template=name`` means for this tokenizer."""
    if name == "auto":
        return JinjaTemplate(tok.chat_template, "auto") if tok.chat_template else \
            ChatTemplate("plain")
    if name == "chatml":
        for token in ("<|im_start|>", "<|im_end|>"):
            if tok.token_to_id(token) is None:
                raise DataError(f"data.template: chatml needs the token {token!r}, which the "
                                "tokenizer lacks")
        return JinjaTemplate(CHATML, "chatml")
    return ChatTemplate(name)


# ----------------------------------------------------------------- built-in pieces

class ChatTemplate:
    """A built-in template that renders messages as (piece, trained) pairs."""

    def __init__(self, name: str):
        self.name = name
        self.source: Optional[str] = None  # no Jinja: nothing to export
        if name not in BUILTIN:
            if "{" not in name:
                raise DataError(f"data.template: {name!r} is not one of "
                                f"{', '.join(CHAT_TEMPLATES)} nor a format string")
            p, r = name.find("{prompt}"), name.find("{response}")
            if name.count("{prompt}") != 1 or name.count("{response}") != 1 or p > r:
                raise DataError("data.template: a format string needs {prompt} and then "
                                "{response}, once each")

    @property
    def fingerprint(self) -> str:
        return self.name

    # -- special tokens
    def end_of_turn(self, tok) -> str:
        """The token string that ends an assistant turn (for generation_config)."""
        return tok.decode([self.end_of_turn_id(tok)], skip_special=False)

    def end_of_turn_id(self, tok) -> int:
        if self.name == "llama3":
            return self._special(tok, "<|eot_id|>")
        return self._eos(tok)

    def _eos(self, tok) -> int:
        if tok.eos_id is None:
            raise DataError(f"data.template: {self.name} needs an end-of-text token, and "
                            "the tokenizer has none")
        return tok.eos_id

    def _special(self, tok, text: str) -> int:
        i = tok.token_to_id(text)
        if i is None:
            raise DataError(f"data.template: {self.name} needs the token {text!r}, which the "
                            "tokenizer lacks (use a Llama-3 tokenizer or another template)")
        return i

    # -- rendering
    def pieces(self, messages: list[dict], tok) -> list[tuple[Piece, bool]]:
        if self.name == "llama3":
            return self._llama3(messages, tok)
        system = messages[0]["content"] if messages[0]["role"] == "system" else None
        turns = [m for m in messages if m["role"] != "system"]
        pairs = [(turns[i]["content"], turns[i + 1]["content"])
                 for i in range(0, len(turns), 2)]
        eos = self._eos(tok)
        if self.name == "llama2":
            out: list[tuple[Piece, bool]] = []
            for n, (user, answer) in enumerate(pairs):
                sys_text = f"<<SYS>>\n{system.strip()}\n<</SYS>>\n\n" if n == 0 and system \
                    else ""
                if tok.bos_id is not None:  # Meta's format writes <s> before every turn
                    out.append((tok.bos_id, False))
                out += [(f"[INST] {sys_text}{user.strip()} [/INST]", False),
                        (f" {answer.strip()}", True), (eos, True)]
            return out
        out = [(i, False) for i in tok.affixes[0]]  # what the tokenizer itself adds
        if self.name == "plain":
            if system:
                out.append((f"{system}\n\n", False))
            for user, answer in pairs:
                out += [(f"{user}\n", False), (answer, True), (eos, True)]
            return out
        cut = self.name.index("{response}")
        prompt_part, answer_suffix = self.name[:cut], self.name[cut + len("{response}"):]
        for n, (user, answer) in enumerate(pairs):
            prompt = f"{system}\n\n{user}" if n == 0 and system else user
            out += [(prompt_part.replace("{prompt}", prompt), False),
                    (answer + answer_suffix, True), (eos, True)]
        return out

    def _llama3(self, messages: list[dict], tok) -> list[tuple[Piece, bool]]:
        start, end, eot = (self._special(tok, t) for t in LLAMA3_TOKENS)
        out: list[tuple[Piece, bool]] = []
        if tok.bos_id is not None:
            out.append((tok.bos_id, False))
        for m in messages:
            trained = m["role"] == "assistant"
            out += [(start, False), (m["role"], False), (end, False), ("\n\n", False),
                    (m["content"], trained), (eot, trained)]
        return out

    def encode(self, messages: list[dict], tok, where: str = "data.template") -> Sample:
        """(token ids, trained flags) of one sample (``where``: its place, for errors)."""
        return self.encode_many([(where, messages)], tok)[0]

    def encode_many(self, samples: list[tuple[str, list[dict]]], tok) -> list[Sample]:
        """Tokenizes many (where, messages) samples with one batched tokenizer call."""
        rendered = [self.pieces(messages, tok) for _, messages in samples]
        texts = [p for pieces in rendered for p, _ in pieces if isinstance(p, str) and p]
        encoded = iter(tok.encode_batch(texts, special_tokens=False)) if texts else iter(())
        out = []
        for pieces in rendered:
            ids: list[int] = []
            trained: list[bool] = []
            for piece, flag in pieces:
                part = [piece] if isinstance(piece, int) else (next(encoded) if piece else [])
                ids += part
                trained += [flag] * len(part)
            out.append((np.asarray(ids, dtype=np.int64), np.asarray(trained, dtype=bool)))
        return out

    def prompt_ids(self, messages: list[dict], tok) -> list[int]:
        """The ids a model trained with this template sees before its next answer
        (``messages`` ends with a user turn)."""
        ids, trained = self.encode(messages + [{"role": "assistant", "content": ""}], tok)
        first = np.flatnonzero(trained)
        return ids[:first[0] if len(first) else len(ids)].tolist()


# ------------------------------------------------------------------ Jinja templates

class JinjaTemplate:
    """A Jinja chat template (the model's own, or a built-in one) rendered sandboxed."""

    def __init__(self, source: str, name: str = "auto", label: str = "data.template"):
        """``label``: what an error names as the template's origin (the config field, or
        the model directory's template file when a command renders the model's own)."""
        self.source, self.name, self.label = source, name, label
        try:
            self._template = _environment().from_string(source)
        except Exception as e:  # jinja2's TemplateSyntaxError and friends
            raise DataError(f"{label}: the chat template does not parse ({_one_line(e)})"
                            ) from None

    @property
    def fingerprint(self) -> str:
        return f"{self.name}:{hashlib.sha1(self.source.encode()).hexdigest()[:16]}"

    def render(self, messages: list[dict], tok, add_generation_prompt: bool = False,
               where: Optional[str] = None) -> str:
        where = where or self.label
        try:
            return self._template.render(messages=messages,
                                         add_generation_prompt=add_generation_prompt,
                                         **tok.special_token_strings())
        except Exception as e:  # raise_exception() in the template, or a rendering bug
            raise DataError(f"{where}: the chat template cannot render this conversation "
                            f"({_one_line(e)})") from None

    def encode(self, messages: list[dict], tok, where: Optional[str] = None) -> Sample:
        return self.encode_many([(where or self.label, messages)], tok)[0]

    def encode_many(self, samples: list[tuple[str, list[dict]]], tok) -> list[Sample]:
        texts, spans = [], []
        for where, messages in samples:
            text = self.render(messages, tok, where=where)
            texts.append(text)
            spans.append(self._reply_spans(messages, text, tok, where))
        out = []
        for (ids, offsets), sample_spans in zip(tok.encode_with_offsets(texts), spans):
            # A token is trained when it overlaps a reply's span (a token may carry the
            # template's space before the content, as Llama-2's " {content}" does).
            spans_of_tokens = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
            starts, ends = spans_of_tokens[:, 0], spans_of_tokens[:, 1]
            trained = np.zeros(len(ids), dtype=bool)
            for begin, stop in sample_spans:
                trained |= (starts < stop) & (ends > begin)
            out.append((np.asarray(ids, dtype=np.int64), trained))
        return out

    def _reply_spans(self, messages: list[dict], text: str, tok, where: str
                     ) -> list[tuple[int, int]]:
        """Character spans [content start, end of the end-of-turn token) of each
        assistant reply in ``text`` (the rendering of all ``messages``)."""
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            start = self._reply_start(messages[:i], text, tok, where)
            turn_end = len(text)
            if i + 1 < len(messages):
                upto = self.render(messages[:i + 1], tok, where=where)
                if text.startswith(upto):
                    turn_end = len(upto)
            content = m["content"]
            found = text.find(content, start, turn_end)
            if found < 0:  # a template that trims the content (a blank one to nothing)
                content = content.strip()
                found = text.find(content, start, turn_end)
            if found < 0:
                raise DataError(f"{where}: the chat template does not write assistant message "
                                f"{i + 1}'s content as it is; lmforge cannot find what to train")
            content_end = found + len(content)
            eot = _first_added_token(text, content_end, turn_end, tok)
            if eot is None:
                raise DataError(f"{where}: the chat template writes no special token after "
                                f"assistant message {i + 1}, so a model trained on it could "
                                "never learn to stop (use another data.template)")
            spans.append((found, eot))
        return spans

    def _reply_start(self, before: list[dict], text: str, tok, where: str) -> int:
        """Where the reply after ``before`` begins: the end of their rendering with the
        generation prompt, or without it when the template writes past turns otherwise."""
        for generation_prompt in (True, False):
            prefix = self.render(before, tok, add_generation_prompt=generation_prompt,
                                 where=where) if before else ""
            if text.startswith(prefix):
                return len(prefix)
        raise DataError(f"{where}: the chat template renders earlier turns differently once "
                        "later ones follow; lmforge cannot tell which tokens are replies")

    def end_of_turn_id(self, tok) -> int:
        """The token that ends an assistant turn (what generation stops on): the last
        trained token of a probe conversation. Refuses a template that cannot train."""
        probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
        ids, trained = self.encode(probe, tok)
        return int(ids[np.flatnonzero(trained)[-1]])

    def end_of_turn(self, tok) -> str:
        return tok.decode([self.end_of_turn_id(tok)], skip_special=False)

    def prompt_ids(self, messages: list[dict], tok) -> list[int]:
        text = self.render(messages, tok, add_generation_prompt=True)
        return tok.encode(text, special_tokens=False)


def _first_added_token(text: str, start: int, stop: int, tok) -> Optional[int]:
    """End offset of the first added (special) token written in ``text[start:stop]``."""
    best = None
    for i in tok.added_token_ids:
        token = tok.id_to_token(i)
        if not token:
            continue
        at = text.find(token, start, stop)
        if at >= 0 and (best is None or at < best[0]):
            best = (at, at + len(token))
    return best[1] if best else None


@lru_cache(maxsize=1)
def _environment():
    """The sandboxed Jinja environment transformers renders chat templates in."""
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """``{% generation %}...{% endgeneration %}`` (assistant-mask markers of some
        templates) renders its body unchanged; replies are found by prefix instead."""
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body)

    def raise_exception(message):
        raise ValueError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _one_line(e: Exception) -> str:
    text = " ".join(str(e).split())
    return text or type(e).__name__
