"""The tokenizer part of a GGUF export (``export.gguf``): which of llama.cpp's
pre-tokenizers splits text as the model's tokenizer does (by behaviour on a probe text,
as llama.cpp's converter names it by what the tokenizer produces), and the vocabulary,
merges, token types and special tokens as llama.cpp reads them."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional

from lmforge.data.templates import get_template
from lmforge.data.tokenizer import Tokenizer, load_tokenizer
from lmforge.models.hf import read_hf_config


class GGUFError(ValueError):
    """What a GGUF export cannot hold; the message names the model, field or dtype."""


def _gguf():
    try:
        import gguf  # optional: the GGUF writer llama.cpp publishes (pip install gguf)
    except ImportError:
        raise GGUFError("--format gguf: needs the gguf package (pip install gguf)") from None
    return gguf


# The regular expressions llama.cpp splits text with, by the name a GGUF gives them
# (``tokenizer.ggml.pre``), written as tokenizer.json writes regexes. llama.cpp applies
# each in turn to the pieces the one before left, then maps bytes to byte-level symbols.
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?"
                r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?"
               r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclasses.dataclass(frozen=True)
class LlamaCppSplit:
    """One way llama.cpp pre-tokenizes: its regexes, whether it takes a whole piece that
    is in the vocabulary without merging (tokenizer.json's ``model.ignore_merges``), and
    its name with and without the decoder's space clean-up (llama.cpp's detokenizer
    removes " ?", " ." ... spaces where ``clean_up_tokenization_spaces`` is true)."""
    regexes: tuple[str, ...]
    ignore_merges: bool
    name_clean: str
    name_plain: str

    def name(self, clean_up: bool) -> str:
        return self.name_clean if clean_up else self.name_plain


LLAMA_CPP_SPLITS = (
    LlamaCppSplit((GPT2_SPLIT,), False, "gpt-2", "gpt-2"),
    LlamaCppSplit((r"\p{N}", GPT2_SPLIT), False, "starcoder", "smollm"),  # digits apart
    LlamaCppSplit((LLAMA3_SPLIT,), True, "llama-bpe", "llama-bpe"),
    LlamaCppSplit((QWEN2_SPLIT,), False, "qwen2", "qwen2"),
)

# Text a pre-tokenizer is identified by: what splits it into pieces differs between the
# regex sets above (runs of digits, contractions in either case, newlines, runs of spaces
# and tabs, punctuation runs, letters and numbers of other scripts, emoji sequences), and
# a first word without a space before it (a pre-tokenizer that adds one is not llama.cpp's).
PROBE_TEXT = (
    "Hello world! It's 2024: we'RE testing 7 digits 1234567 and 3.14, 3..3, -42% off.\n"
    "  two spaces\tTab\t\tand\r\nCRLF\n\n\n   indented   \n \n"
    "naïve café e\u0301 Ærøskøbing straße ﬁnal ÀÉÎ\n"
    "日本語のテキスト 中文123 한국어 Привет, мир! Ελληνικά العربية हिन्दी ខ្មែរ\n"
    "emoji 🚀🦙 😶\u200d🌫️ ✅ 1️⃣ ½ ² Ⅻ ١٢٣ ５６\n"
    "code: foo_bar(x)=[1,2]; // ?!... \'\'\' \"\"\" ``` ---=== I'M 'tis he'll 'D we'Ve a'lL\n"
    "ends with spaces   ")

# Normalizers llama.cpp's BPE tokenizer does without (it normalizes nothing): NFC leaves
# text that is already composed, as text usually is, unchanged.
HARMLESS_NORMALIZERS = (None, "NFC")


def pre_tokenizer(model_dir: Path) -> str:
    """The name llama.cpp gives the tokenizer's pre-tokenizer, found by what it does: the
    pieces it splits ``PROBE_TEXT`` into are those of one of llama.cpp's regex sets
    (``LLAMA_CPP_SPLITS``), byte-level mapped. Refused when the tokenizer is not
    byte-level BPE, or when llama.cpp would split or merge text differently."""
    import tokenizers

    load_tokenizer(model_dir)  # (refuses a file tokenizers cannot read, naming it)
    path = model_dir / "tokenizer.json"
    spec = json.loads(path.read_text(encoding="utf-8"))
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise GGUFError(f"{path}: a {model.get('type')} tokenizer; the GGUF export writes "
                        f"byte-level BPE tokenizers only")
    normalizer = (spec.get("normalizer") or {}).get("type")
    if normalizer not in HARMLESS_NORMALIZERS:
        raise GGUFError(f"{path}: normalizer: {normalizer}; llama.cpp normalizes nothing "
                        f"before a BPE vocabulary, so it would tokenize text differently")
    tok = tokenizers.Tokenizer.from_file(str(path))
    if tok.pre_tokenizer is None:
        raise GGUFError(f"{path}: no pre_tokenizer; llama.cpp splits text before BPE, so "
                        f"it would tokenize text differently")
    pieces = tok.pre_tokenizer.pre_tokenize_str(PROBE_TEXT)
    split = next((s for s in LLAMA_CPP_SPLITS if _pieces(s, PROBE_TEXT) == pieces), None)
    if split is None:
        raise GGUFError(f"{path}: its pre_tokenizer splits text unlike any pre-tokenizer "
                        f"llama.cpp knows by name ({_first_difference(pieces)}); the GGUF "
                        f"export writes byte-level BPE tokenizers that split as GPT-2, "
                        f"StarCoder/SmolLM, Llama 3 or Qwen2 do")
    name = split.name(_clean_up(model_dir))
    if bool(model.get("ignore_merges", False)) != split.ignore_merges:
        raise GGUFError(f"{path}: model.ignore_merges is {bool(model.get('ignore_merges'))}"
                        f" where llama.cpp's {name!r} pre-tokenizer, which splits text as "
                        f"this one, has it {split.ignore_merges}: it would merge some words "
                        f"differently")
    return name


def _pieces(split: LlamaCppSplit, text: str) -> list:
    """``text`` split by ``split``'s regexes and byte-level mapped, as tokenizers reports
    pieces: (piece, (start, end))."""
    from tokenizers import Regex, pre_tokenizers

    steps = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in split.regexes]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(steps).pre_tokenize_str(text)


def _first_difference(pieces: list) -> str:
    """Where the tokenizer's pieces first differ from llama.cpp's GPT-2 split's."""
    gpt2 = _pieces(LLAMA_CPP_SPLITS[0], PROBE_TEXT)
    shown = lambda p: f"{PROBE_TEXT[p[1][0]:p[1][1]][:20]!r} as {p[0][:20]!r}"  # noqa: E731
    for ours, theirs in zip(pieces, gpt2):
        if ours != theirs:
            return f"its first piece unlike GPT-2's split: {shown(ours)}, where GPT-2's " \
                   f"is {shown(theirs)}"
    return f"{len(pieces)} pieces where GPT-2's split makes {len(gpt2)}"


def _clean_up(model_dir: Path) -> bool:
    """tokenizer_config.json's ``clean_up_tokenization_spaces`` (transformers' default,
    false, where it is not set)."""
    config = _tokenizer_config(model_dir)
    return config.get("clean_up_tokenization_spaces") is True


def _tokenizer_config(model_dir: Path) -> dict:
    path = model_dir / "tokenizer_config.json"
    if not path.is_file():
        return {}
    config = json.loads(path.read_text(encoding="utf-8"))
    return config if isinstance(config, dict) else {}


def write_tokenizer(writer, model_dir: Path, tok: Tokenizer, n_vocab: int, pre: str) -> None:
    """Tokens (padded to the model's vocabulary), their types, merges, special ids and the
    chat template; EOS is the template's end-of-turn token where there is a template."""
    gguf = _gguf()
    spec = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    types = [gguf.TokenType.UNUSED] * n_vocab
    for token, i in spec["model"]["vocab"].items():
        tokens[i], types[i] = token, gguf.TokenType.NORMAL
    for added in spec.get("added_tokens", []):
        i = added["id"]
        tokens[i] = added["content"]
        types[i] = gguf.TokenType.CONTROL if added["special"] else gguf.TokenType.USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    before, after = tok.affixes
    if tok.bos_id is not None:
        writer.add_bos_token_id(tok.bos_id)
    writer.add_add_bos_token(bool(before) and before == [tok.bos_id])
    writer.add_add_eos_token(bool(after))
    eos = end_of_turn(tok)
    if eos is not None:
        writer.add_eos_token_id(eos)
    for role, add in (("unk", writer.add_unk_token_id), ("pad", writer.add_pad_token_id)):
        i = named_token(model_dir, tok, role, n_vocab)
        if i is not None:
            add(i)
    if tok.chat_template:
        writer.add_chat_template(tok.chat_template)


def named_token(model_dir: Path, tok: Tokenizer, role: str, n_vocab: int) -> Optional[int]:
    """The id of the ``role`` ("unk", "pad") token the tokenizer's files name, as llama.cpp's
    converter finds it: tokenizer_config.json's ``<role>_token``, else config.json's
    ``<role>_token_id``; None where neither names one (nothing is guessed)."""
    named = _tokenizer_config(model_dir).get(f"{role}_token")
    named = named.get("content") if isinstance(named, dict) else named
    if isinstance(named, str) and tok.token_to_id(named) is not None:
        return tok.token_to_id(named)
    i = read_hf_config(model_dir).get(f"{role}_token_id")
    if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n_vocab:
        return i
    return None


def end_of_turn(tok: Tokenizer) -> Optional[int]:
    """The chat template's end-of-turn token, else the tokenizer's EOS."""
    if tok.chat_template:
        return get_template("auto", tok).end_of_turn_id(tok)
    return tok.eos_id
