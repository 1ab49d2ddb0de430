"""A thin wrapper over Hugging Face ``tokenizers``: load a model directory's
``tokenizer.json``, and train a byte-level BPE tokenizer on local files."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Iterator, Optional

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"


class TokenizerError(ValueError):
    pass


class Tokenizer:
    """Encode/decode plus the special ids the trainer needs (bos, eos, pad)."""

    def __init__(self, tok: _HFTokenizer, bos_id: Optional[int], eos_id: Optional[int],
                 pad_id: Optional[int] = None, path: Optional[Path] = None):
        self._tok = tok
        self.bos_id, self.eos_id = bos_id, eos_id
        self.pad_id = pad_id if pad_id is not None else eos_id
        self.path = path

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        if eos and self.eos_id is not None:
            ids = ids + [self.eos_id]
        return ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special)

    def token_to_id(self, token: str) -> Optional[int]:
        return self._tok.token_to_id(token)

    def save(self, out_dir: str | Path) -> None:
        """Writes tokenizer.json and a tokenizer_config.json transformers understands."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(out / "tokenizer.json"))
        name = lambda i: self._tok.id_to_token(i) if i is not None else None  # noqa: E731
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": name(self.bos_id), "eos_token": name(self.eos_id),
            "pad_token": name(self.pad_id), "add_bos_token": False, "add_eos_token": False,
            "clean_up_tokenization_spaces": False, "model_max_length": 1_000_000,
        }
        if self._chat_template:
            config["chat_template"] = self._chat_template
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))

    _chat_template: Optional[str] = None


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """Loads ``tokenizer.json`` (+ tokenizer_config.json for the special tokens)."""
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
    out = Tokenizer(tok, ids["bos"], ids["eos"], ids["pad"], path=root)
    out._chat_template = config.get("chat_template")
    return out


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


def iter_text_files(paths: Iterable[str | Path], suffixes=(".txt", ".md", ".py", ".rst")
                    ) -> Iterator[Path]:
    """Files under ``paths`` (files as given, directories walked in sorted order)."""
    for p in map(Path, paths):
        if p.is_dir():
            yield from sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in suffixes)
        elif p.is_file():
            yield p
        else:
            raise TokenizerError(f"{p}: no such file or directory")


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path}: not valid JSON ({e})") from None


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
