"""A thin wrapper over Hugging Face ``tokenizers``: load a model directory's
``tokenizer.json``, and train a byte-level BPE tokenizer on local files."""
from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import Iterable, Iterator, Optional

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from lmforge.data.errors import at
from lmforge.data.readers import input_kind, iter_record_texts, skipped_path

BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst")
# Read as records, the text under a JSON key (a parquet column), as preprocess reads them.
RECORD_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".parquet")
CORPUS_SUFFIXES = TEXT_SUFFIXES + RECORD_SUFFIXES  # what a directory of a corpus gives


class TokenizerError(ValueError):
    pass


class Tokenizer:
    """Encode/decode plus the special ids the trainer needs (bos, eos, pad).

    Special tokens follow the tokenizer's own rules: ``encode(text)`` applies its
    post-processor, as ``transformers``' ``add_special_tokens=True`` does (that is where
    Llama-2 and Llama-3 get their BOS; a ChatML tokenizer adds nothing). ``bos_id`` is
    the configured ``bos_token``, which templates may write; nothing adds it on a guess.
    """

    def __init__(self, tok: _HFTokenizer, bos_id: Optional[int], eos_id: Optional[int],
                 pad_id: Optional[int] = None, path: Optional[Path] = None,
                 config: Optional[dict] = None, chat_template: Optional[str] = None):
        self._tok = tok
        self.bos_id, self.eos_id = bos_id, eos_id
        self.pad_id = pad_id if pad_id is not None else eos_id
        self.path = path
        self.config = config or {}  # tokenizer_config.json as loaded (kept on save)
        self.chat_template = chat_template

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, special_tokens: bool = True) -> list[int]:
        """``special_tokens=False``: the text alone (a piece of a template, say)."""
        return self._tok.encode(text, add_special_tokens=special_tokens).ids

    def encode_batch(self, texts: list[str], special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=special_tokens)]

    def encode_with_offsets(self, texts: list[str]) -> list[tuple[list[int], list[tuple]]]:
        """(ids, character spans) of each text, without special tokens added (the text
        of a rendered chat template already holds them, as in ``apply_chat_template``)."""
        return [(e.ids, e.offsets) for e in self._tok.encode_batch(texts,
                                                                   add_special_tokens=False)]

    @cached_property
    def affixes(self) -> tuple[list[int], list[int]]:
        """The ids the post-processor puts before and after one text (BOS, EOS...)."""
        probe = "a"
        bare = self.encode(probe, special_tokens=False)
        full = self.encode(probe)
        for start in range(len(full) - len(bare) + 1):
            if full[start:start + len(bare)] == bare:
                return full[:start], full[start + len(bare):]
        raise TokenizerError(f"{self.path or 'tokenizer'}: its post-processor changes the "
                             "text's own tokens; lmforge cannot tell what it adds")

    @property
    def eos_ids(self) -> list[int]:
        """``[eos_id]``, or none: what ends a document and stops generation."""
        return [] if self.eos_id is None else [self.eos_id]

    @cached_property
    def added_token_ids(self) -> frozenset[int]:
        """Ids of the added (special and control) tokens: where a chat turn can end."""
        ids = set(self._tok.get_added_tokens_decoder())
        return frozenset(ids | set(self.eos_ids))

    def special_token_strings(self) -> dict[str, str]:
        """``bos_token``, ``eos_token``, ... as strings, for chat templates."""
        out = {}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            value = self.config.get(key)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                out[key] = value
        for key, i in (("bos_token", self.bos_id), ("eos_token", self.eos_id)):
            if key not in out and i is not None:
                out[key] = self._tok.id_to_token(i)
        return out

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special)

    def token_to_id(self, token: str) -> Optional[int]:
        return self._tok.token_to_id(token)

    def id_to_token(self, i: int) -> Optional[str]:
        return self._tok.id_to_token(i)

    def with_chat_template(self, template: Optional[str]) -> "Tokenizer":
        """The same tokenizer carrying ``template`` (kept when it is saved)."""
        return Tokenizer(self._tok, self.bos_id, self.eos_id, self.pad_id, self.path,
                         self.config, template)

    def save(self, out_dir: str | Path) -> None:
        """Writes tokenizer.json and tokenizer_config.json (the loaded one, or one
        transformers understands), with the chat template inside."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(out / "tokenizer.json"))
        name = lambda i: self._tok.id_to_token(i) if i is not None else None  # noqa: E731
        config = dict(self.config) or {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": name(self.bos_id), "eos_token": name(self.eos_id),
            "pad_token": name(self.pad_id),
            "clean_up_tokenization_spaces": False, "model_max_length": 1_000_000,
        }
        config.pop("chat_template", None)
        if self.chat_template:
            config["chat_template"] = self.chat_template
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """Loads ``tokenizer.json`` (+ tokenizer_config.json for the special tokens, and the
    chat template from there or from ``chat_template.jinja``)."""
    root = Path(model_dir)
    path = root / "tokenizer.json"
    if not path.is_file():
        raise TokenizerError(f"{path}: not found (a model directory needs tokenizer.json)")
    try:
        tok = _HFTokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON
        raise TokenizerError(f"{path}: not a valid tokenizer file ({_first_line(e)})") from None
    config = _read_json(root / "tokenizer_config.json")
    ids = {}
    for role, fallbacks in (("bos", (BOS, "<s>")), ("eos", (EOS, "</s>", "<|eot_id|>")),
                            ("pad", (PAD,))):
        ids[role] = _special_id(tok, config.get(f"{role}_token"), fallbacks)
    return Tokenizer(tok, ids["bos"], ids["eos"], ids["pad"], path=root, config=config,
                     chat_template=_chat_template(root, config))


def check_fits_vocabulary(tok: Tokenizer, vocab_size: int, model_dir: str | Path) -> None:
    """Refuse a tokenizer with more tokens than the weights have rows: an id past them
    has no embedding (an index error deep in the model) and no logit to be generated by.
    Fewer is fine (a vocabulary padded to a multiple of 64)."""
    if tok.vocab_size > vocab_size:
        raise TokenizerError(f"{model_dir}: the tokenizer has {tok.vocab_size} tokens, the "
                             f"weights' vocabulary {vocab_size} (config.json vocab_size): "
                             f"the ids past it have no embedding (use the tokenizer the "
                             f"model was trained with)")


def chat_template_origin(model_dir: str | Path) -> str:
    """Where ``load_tokenizer`` took the directory's chat template from, as an error names
    it: ``…/chat_template.jinja``, else ``…/tokenizer_config.json: chat_template``."""
    root = Path(model_dir)
    if (root / "chat_template.jinja").is_file():
        return str(root / "chat_template.jinja")
    return f"{root / 'tokenizer_config.json'}: chat_template"


def _chat_template(root: Path, config: dict) -> Optional[str]:
    """transformers' places: ``chat_template.jinja``, else tokenizer_config.json's
    ``chat_template`` (a string, or a list of named ones where "default" is used)."""
    jinja = root / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template.strip() else None


def _special_id(tok: _HFTokenizer, configured, fallbacks) -> Optional[int]:
    if isinstance(configured, dict):  # older configs store AddedToken dicts
        configured = configured.get("content")
    for name in ([configured] if configured else []) + list(fallbacks):
        i = tok.token_to_id(name)
        if i is not None:
            return i
    return None


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE (the GPT-2 / Llama-3 family) trained on an iterator of texts."""
    tok = _HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = [BOS, EOS, PAD]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2)
    tok.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(tok, tok.token_to_id(BOS), tok.token_to_id(EOS), tok.token_to_id(PAD))


def iter_text_files(paths: Iterable[str | Path], suffixes=TEXT_SUFFIXES) -> Iterator[Path]:
    """Files under ``paths`` (files as given, directories walked in sorted order for names
    ending in one of ``suffixes``, past hidden ones and lmforge's caches, as preprocess
    walks them)."""
    for p in map(Path, paths):
        if p.is_dir():
            yield from sorted(f for f in p.rglob("*") if f.is_file()
                              and f.name.endswith(tuple(suffixes))
                              and not skipped_path(f.relative_to(p)))
        elif p.is_file():
            yield p
        else:
            raise TokenizerError(f"{p}: no such file or directory")


def read_text(path: Path) -> str:
    """A file's whole text. Bytes that are not UTF-8 are refused, naming the file, the
    line and the byte offset: replacing them would train on noise (a binary file, or a
    text in another encoding)."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise at(path, data.count(b"\n", 0, e.start) + 1,
                 f"not valid UTF-8 (byte 0x{data[e.start]:02x} at byte offset {e.start}; "
                 f"convert the file to UTF-8)") from None


def training_texts(files: Iterable[Path], json_keys: Iterable[str] = ("text",)
                   ) -> Iterator[str]:
    """The documents of a corpus (what a tokenizer, or ``data.kind=text``, trains on): of a
    JSON Lines / JSON array / parquet file, the text under each of ``json_keys`` in each
    record (never the JSON syntax around it; a bad record stops with file:line); of any
    other file, its whole text (``read_text``). Blank documents are left out, as
    preprocess leaves them out."""
    for path in map(Path, files):
        if input_kind(path) in RECORD_SUFFIXES:
            texts = iter_record_texts(path, list(json_keys))
        else:
            texts = [read_text(path)]
        yield from (text for text in texts if text.strip())


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path}: not valid JSON ({e})") from None


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
