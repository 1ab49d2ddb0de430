"""Supervised fine-tuning samples: chat templates, loss masks, packing.

Input: JSON Lines, one sample per line, either ``{"prompt": ..., "response": ...}``
(optional ``"system"``) or ``{"messages": [{"role": "system"|"user"|"assistant",
"content": ...}, ...]}`` (an optional system message first, then user and assistant
turns alternating; a trailing user turn has nothing to learn from and is dropped).

Templates (``data.template``: auto, the model's own, by default) are in
``lmforge.data.templates``; they decide the ids and which of them are trained: only the
assistant's content and its end-of-turn token.

Truncation: a sample longer than ``seq_len + 1`` tokens keeps its first ``seq_len + 1``
(the end of the last answer is cut); ``truncated_samples`` and ``truncated_tokens`` count
those samples and the tokens cut off them (the trainer prints and records both). A sample
left with no trained target is dropped, and the count is reported. A record with an empty
(or blank) assistant answer would teach only the end-of-turn token: it is skipped and
counted (``empty_answers``, printed and recorded too); a file of nothing else is refused.

Padding, grouping by length and packing: ``lmforge.data.sft_rows``.

Held-out samples (``holdout = (part, eval_fraction)``, when there is no data.eval_path):
``held_out_documents`` picks ``eval_fraction`` of the records by a fixed hash of their
index in the file, as pretraining picks documents, so the split depends on neither the
seed, the data-parallel layout nor packing; ``part="train"`` reads (and packs) only the
others, ``"eval"`` only those, rendered and masked alike.

Tokenized samples and packing plans are cached under the data cache directory
(``lmforge.data.cache``: ``$LMFORGE_CACHE``, by default ``~/.cache/lmforge``), keyed by the
file's path and content, the tokenizer and the template, never beside the data; the tokens
are shared by both parts, a packing plan is named by its part and fraction.
"""
from __future__ import annotations

import hashlib
import warnings
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from lmforge.data.cache import (cache_dir_for, content_fingerprint, keyed_dir, load_or_build,
                                save_npy)
from lmforge.data.dataset import collate, held_out_documents, rng_for, split_documents
from lmforge.data.errors import DataError
from lmforge.data.indexed import IndexedDataset, IndexedDatasetWriter, token_dtype
from lmforge.data.indexed_files import exists
from lmforge.data.records import iter_jsonl
from lmforge.data.sft_rows import PlannedRows, group_by_length, pack_first_fit, sft_row
from lmforge.data.templates import get_template

ROLES = ("system", "user", "assistant")
# 2: special tokens follow the tokenizer's rules; Jinja templates. 3: EMPTY_ANSWER marks.
SFT_CACHE_VERSION = 3
EMPTY_ANSWER = -2  # first_trained of a record with an empty assistant answer


# --------------------------------------------------------------------------- records

def record_messages(obj, where: str) -> list[dict]:
    """A record as a checked list of messages; DataError ``where: reason`` if bad."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object")
    if "messages" in obj:
        messages = obj["messages"]
        if not isinstance(messages, list) or not messages:
            raise DataError(f"{where}: 'messages' must be a non-empty list")
    elif "prompt" in obj or "response" in obj:
        for key in ("prompt", "response"):
            if not isinstance(obj.get(key), str):
                raise DataError(f"{where}: {key!r} must be a string")
        messages = [{"role": "user", "content": obj["prompt"]},
                    {"role": "assistant", "content": obj["response"]}]
        messages[:0] = system_message(obj, where)
    else:
        raise DataError(f"{where}: expected keys 'prompt' and 'response', or 'messages'")
    out = checked_messages(messages, where)
    while out and out[-1]["role"] != "assistant":
        out.pop()
    if not out:
        raise DataError(f"{where}: no assistant message to train on")
    return out


def system_message(obj: dict, where: str) -> list[dict]:
    """The optional ``"system"`` of a record of strings, as a message list (maybe empty)."""
    system = obj.get("system")
    if system is None:
        return []
    if not isinstance(system, str):
        raise DataError(f"{where}: 'system' must be a string")
    return [{"role": "system", "content": system}]


def checked_messages(messages: list, where: str, name=lambda i: f"message {i}"
                     ) -> list[dict]:
    """``messages`` checked (a string 'content', a known role, a system message first,
    then user and assistant alternating) and copied; a reason names message ``i``
    (from 1) as ``name(i)`` says."""
    out = []
    for i, m in enumerate(messages, 1):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: {name(i)} needs a string 'content'")
        role = m.get("role")
        if role not in ROLES:
            raise DataError(f"{where}: {name(i)} has role {_short(role)} (use "
                            f"{', '.join(ROLES)})")
        expected = ("system", "user") if not out else \
            ("assistant",) if out[-1]["role"] == "user" else ("user",)
        if role not in expected:
            raise DataError(f"{where}: {name(i)} is {role!r}, expected "
                            f"{' or '.join(map(repr, expected))} (a system message first, "
                            "then user and assistant alternating)")
        out.append({"role": role, "content": m["content"]})
    return out


def _short(value, limit: int = 40) -> str:
    """``repr(value)``, cut to ``limit`` characters (a message never holds a whole
    field of the user's data)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def empty_answer(messages: list[dict]) -> bool:
    """Whether an assistant message of ``messages`` is empty or blank: it would teach
    only the end-of-turn token (whitespace-only counts as empty: it trains no text)."""
    return any(m["role"] == "assistant" and not m["content"].strip() for m in messages)


# ---------------------------------------------------------------------------- reading

def tokenizer_fingerprint(tok) -> str:
    inner = getattr(tok, "_tok", None)
    text = inner.to_str() if inner is not None else repr(
        (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id))
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def tokenize_file(path: Path, template, tok, out_dir: Path, batch: int = 256) -> None:
    """Writes ``tokens`` and ``trained`` indexed datasets and ``first_trained.npy``
    (index of each sample's first trained token after the first, -1 if none,
    ``EMPTY_ANSWER`` for a record with an empty assistant answer)."""
    dtype = token_dtype(tok.vocab_size)
    first: list[int] = []
    with IndexedDatasetWriter(out_dir / "tokens", dtype) as tokens, \
            IndexedDatasetWriter(out_dir / "trained", np.uint8) as trained:
        pending: list = []

        def flush():
            for (_, messages), (ids, flags) in zip(pending, template.encode_many(pending, tok)):
                tokens.add_document(ids)
                trained.add_document(flags.astype(np.uint8))
                hits = np.flatnonzero(flags[1:])
                first.append(EMPTY_ANSWER if empty_answer(messages) else
                             int(hits[0]) + 1 if len(hits) else -1)
            pending.clear()

        for n, obj in iter_jsonl(path):
            where = f"{path}:{n}"
            pending.append((where, record_messages(obj, where)))
            if len(pending) >= batch:
                flush()
        flush()
    save_npy(out_dir / "first_trained.npy", np.asarray(first, dtype=np.int64))


def tokenized(path: Path, kind: str, version: int, template, tok,
              cache_dir: Optional[Path], tokenize) -> tuple[Path, IndexedDataset,
                                                             IndexedDataset]:
    """(cache directory, ``tokens``, ``trained``) of a JSON Lines file rendered with
    ``template``: ``tokenize(path, template, tok, out_dir)`` writes them (and
    ``first_trained.npy``) once per file content, template and tokenizer."""
    params = {"kind": kind, "version": version, "template": template.fingerprint,
              "tokenizer": tokenizer_fingerprint(tok)}
    cache = keyed_dir(cache_dir_for(str(path), kind, cache_dir), params,
                      content_fingerprint(str(path)))
    if not (exists(cache / "tokens") and exists(cache / "trained")
            and (cache / "first_trained.npy").is_file()):
        tokenize(path, template, tok, cache)
    return cache, IndexedDataset(cache / "tokens"), IndexedDataset(cache / "trained")


def check_some_answer(field: str, path: Path) -> None:
    """Refuses (before a run writes anything) an SFT file that is missing or whose every
    record has an empty answer. Reads up to the first record with one: usually one line."""
    if not Path(path).is_file():
        raise DataError(f"{field}: {path}: no such file (SFT data is JSON Lines)")
    records = 0
    for n, obj in iter_jsonl(Path(path)):
        records += 1
        if not empty_answer(record_messages(obj, f"{path}:{n}")):
            return
    raise DataError(f"{field}: {path}: every record's assistant answer is empty ({records} "
                    f"records): nothing to train on")


def held_out_records(path: Path, eval_fraction: float) -> Iterator[tuple[int, object]]:
    """(line number, parsed object) of the records ``eval_fraction`` holds out of an SFT
    file (those ``SFTDataset``'s "eval" part reads), in file order."""
    held = set(held_out_documents(sum(1 for _ in iter_jsonl(path)), eval_fraction).tolist())
    return (record for i, record in enumerate(iter_jsonl(path)) if i in held)


# -------------------------------------------------------------------------- dataset

class SFTDataset(PlannedRows):
    """The never-ending stream of SFT rows: epoch ``e`` shuffles the samples with
    ``(seed, e)`` (and packs them when ``pack``); ``ds[k]`` is global row ``k``, padded
    to ``seq_len``, and ``batch_rows(ks)`` rows ``ks`` padded as one batch.
    ``holdout``: (part, eval_fraction), only that part's samples; ``pad_to_multiple_of``
    and ``group_size`` (samples per optimizer step, to group by length): see the module
    doc (both ignored when packing: packed rows are ``seq_len`` wide)."""

    _ORDER, _GROUPS = 3, 4  # rng purposes

    def __init__(self, path: str | Path, tokenizer, template: str, seq_len: int,
                 seed: int = 0, pack: bool = False, cache_dir: Optional[Path] = None,
                 holdout: Optional[tuple[str, float]] = None,
                 pad_to_multiple_of: Optional[int] = None, group_size: Optional[int] = None):
        self.path = Path(path)
        if not self.path.is_file():
            raise DataError(f"data.path: {self.path}: no such file (SFT data is JSON Lines)")
        self.template = get_template(template, tokenizer)
        self.seq_len, self.seed, self.pack = int(seq_len), int(seed), bool(pack)
        self.pad_to_multiple_of = None if pack else pad_to_multiple_of
        self.group_size = 0 if pack else int(group_size or 0)
        self.pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else 0
        self.end_of_turn_id = self.template.end_of_turn_id(tokenizer)
        self.cache, self.tokens, self.trained = tokenized(
            self.path, "sft", SFT_CACHE_VERSION, self.template, tokenizer, cache_dir,
            tokenize_file)
        # in the names of packing plans: another part or fraction packs other samples
        self._part_tag = "" if holdout is None else f"-{holdout[0]}{float(holdout[1])}"
        self.rows, self.dropped, self.empty_answers = self._usable_samples(
            np.load(self.cache / "first_trained.npy"), holdout)
        lengths = self.tokens.sequence_lengths.astype(np.int64)
        cut = np.maximum(lengths[self.rows] - (self.seq_len + 1), 0)  # of the kept samples
        self.truncated_samples, self.truncated_tokens = int((cut > 0).sum()), int(cut.sum())
        self.sizes = np.minimum(lengths, self.seq_len + 1) - 1  # positions each sample fills
        self._start_stream()

    def _usable_samples(self, first: np.ndarray, holdout: Optional[tuple[str, float]]
                        ) -> tuple[np.ndarray, int, int]:
        """(this part's usable sample ids, how many of its samples were dropped, how many
        skipped for an empty answer): a sample is usable if its answers hold text and a
        trained token survives truncation to seq_len + 1."""
        ids, which = np.arange(len(first)), ""
        if holdout is not None:
            part, fraction = holdout
            ids = split_documents(len(first), fraction, part)
            which = f" ({'held-out' if part == 'eval' else 'training'} samples)"
            if len(ids) in (0, len(first)):  # nothing held out
                raise DataError(f"{self.path}: too few samples ({len(first)}) to hold out "
                                f"data.eval_fraction={fraction} of them and train on the rest")
        usable = ids[(first[ids] >= 1) & (first[ids] <= self.seq_len)]
        empty = int((first[ids] == EMPTY_ANSWER).sum())
        if empty == len(ids):
            raise DataError(f"{self.path}{which}: every record's assistant answer is empty "
                            f"({empty} records): nothing to train on")
        if not len(usable):
            raise DataError(f"{self.path}{which}: no sample has a trained token within the "
                            f"first seq_len + 1 = {self.seq_len + 1} tokens")
        dropped = len(ids) - len(usable) - empty
        if dropped:
            warnings.warn(f"{self.path}{which}: {dropped} of {len(ids)} samples dropped (no "
                          f"assistant token within seq_len + 1 = {self.seq_len + 1} tokens)",
                          stacklevel=3)
        return usable, dropped, empty

    @property
    def num_tokens(self) -> int:
        """Tokens of this part's samples as its rows hold them (each cut to seq_len + 1)."""
        return int((self.sizes[self.rows] + 1).sum())

    def fingerprint(self) -> list:
        return [len(self.rows), int(self.tokens.num_tokens)]

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return self.tokens[i].astype(np.int64), self.trained[i].astype(bool)

    def _build_epoch_plan(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        order = self.rows[rng_for(self.seed, epoch, self._ORDER).permutation(len(self.rows))]
        if self.pack:
            plan = load_or_build(
                self.cache / f"pack-s{self.seq_len}-seed{self.seed}{self._part_tag}-"
                f"epoch{epoch:06d}.npy",
                lambda: self._packed(order))
            n_rows = int(plan[0])  # stored as [rows, offsets..., sample ids...]
            offsets, items = plan[1:n_rows + 2], plan[n_rows + 2:]
        else:
            offsets, items = np.arange(len(order) + 1), self._grouped(order, epoch)
        return np.asarray(offsets), np.asarray(items)

    def _grouped(self, order: np.ndarray, epoch: int) -> np.ndarray:
        if not self.group_size:
            return order
        into_step = (-epoch * len(self.rows)) % self.group_size  # the epoch's start mid-step
        return group_by_length(order, self.sizes, self.group_size,
                               rng_for(self.seed, epoch, self._GROUPS), into_step)

    def _packed(self, order: np.ndarray) -> np.ndarray:
        offsets, items = pack_first_fit(order, self.sizes, self.seq_len)
        return np.concatenate([[len(offsets) - 1], offsets, items]).astype(np.int64)

    def __getitem__(self, k: int) -> dict:
        return self._row(k, self.seq_len)

    def _row(self, k: int, width: int) -> dict:
        return sft_row([self.sample(i) for i in self.samples_of(k)], self.seq_len,
                       self.pad_id, self.pack, width)

    def batch_rows(self, ks: list[int]) -> list[dict]:
        """Rows ``ks`` as one batch: padded to their longest, rounded up to a multiple
        of ``pad_to_multiple_of`` (at most seq_len), or to seq_len without one."""
        longest = max(int(self.sizes[self.samples_of(k)].sum()) for k in ks)
        width = int(self._widths(np.int64(longest)))
        return [self._row(k, width) for k in ks]

    def batch(self, ks: list[int]) -> dict:
        return collate(self.batch_rows(ks), ks)

    def _widths(self, longest: np.ndarray) -> np.ndarray:
        """The row width of batches whose longest rows fill ``longest`` positions."""
        m = self.pad_to_multiple_of
        if not m:
            return np.full_like(longest, self.seq_len)
        return np.minimum(-(-longest // m) * m, self.seq_len)

    def padding_share(self, micro_batch_size: int) -> float:
        """The share of epoch 0's positions that are padding, in batches of
        ``micro_batch_size`` consecutive rows (each rank's micro-batches; see sampler)."""
        offsets, items = self.epoch_plan(0)
        filled = np.add.reduceat(self.sizes[items], offsets[:-1])  # positions of each row
        starts = np.arange(0, len(filled), micro_batch_size)
        widths = self._widths(np.maximum.reduceat(filled, starts))
        rows = np.diff(np.append(starts, len(filled)))
        return 1.0 - float(filled.sum()) / float((widths * rows).sum())
