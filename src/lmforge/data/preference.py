"""Preference pairs (``data.kind=preference``): a prompt with a chosen and a rejected
completion, in the JSON Lines formats TRL reads:

* ``{"prompt": str, "chosen": str, "rejected": str}`` (optional ``"system"``);
* ``{"prompt": [messages], "chosen": [assistant message(s)], "rejected": [...]}``;
* ``{"chosen": [conversation], "rejected": [conversation]}``: the prompt is the messages
  both share from the start, the rest are the completions.

Each side renders with the model's own chat template (``data.template``, as SFT), and only
its completion's trained tokens (the assistant content and end-of-turn token after the
prompt) carry a label. The completion starts where the template's rendering of the prompt
with the generation prompt ends (where the two token sequences diverge, when the tokens
merge across that boundary, as TRL does).

Length limits, as TRL: a prompt over ``data.max_prompt_len`` tokens keeps its last ones
(cut from the left), then the sequence keeps its first ``data.seq_len + 1`` tokens (the
completion is cut from the right); both are counted and reported. A pair with no
completion token left on either side is skipped and counted. A record missing a key, or
whose completion does not end with an assistant turn, is refused with file:line and the
field at fault (``'prompt' message 2``, ``'chosen'``); one whose chosen and rejected
completions are the same is skipped and counted. A pair whose chosen or rejected
completion is empty or blank (whitespace only: SFT's rule for an answer) would teach the
model to prefer, or to avoid, saying nothing: it is skipped and counted, in every format,
and a file of nothing else is refused (``check_some_pair`` before a run, the dataset
for each part and for ``lmforge eval --objective``).

A batch of n pairs holds the n chosen sequences then the n rejected ones (TRL's order),
as rows padded to the longest, or packed (``data.pack``): both sides of several pairs in
rows of ``2 x seq_len`` positions, each sequence with its own positions and a
block-causal mask. ``slots`` says which of the 2n sequences each position's label is
for (``models.preference.pair_logps``); ``n_pairs`` is the batch's pair count.
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from lmforge.data.cache import save_npy
from lmforge.data.dataset import collate, rng_for, split_documents
from lmforge.data.errors import DataError
from lmforge.data.indexed import IndexedDatasetWriter, token_dtype
from lmforge.data.sft import (checked_messages, empty_answer, iter_jsonl, system_message,
                              tokenized)
from lmforge.data.sft_rows import PlannedRows, pack_first_fit, sft_row
from lmforge.data.templates import get_template

PREFERENCE_CACHE_VERSION = 2  # 2: EMPTY_COMPLETION marks
SAME_COMPLETIONS = -3  # first_trained of a pair whose chosen and rejected are the same
EMPTY_COMPLETION = -2  # first_trained of a pair with an empty (or blank) completion


# --------------------------------------------------------------------------- records

def record_pair(obj, where: str) -> tuple[list[dict], list[dict], list[dict]]:
    """(prompt, chosen, rejected) messages of one record; DataError ``where: reason``,
    the reason naming the field at fault."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object")
    for key in ("chosen", "rejected"):
        if key not in obj:
            raise DataError(f"{where}: missing key {key!r} (a preference record has "
                            f"'chosen' and 'rejected', and 'prompt' unless both are whole "
                            f"conversations)")
    prompt, chosen, rejected = obj.get("prompt"), obj["chosen"], obj["rejected"]
    if isinstance(prompt, str) or (prompt is None and isinstance(chosen, str)):
        if prompt is None:
            raise DataError(f"{where}: missing key 'prompt' (string 'chosen' and "
                            f"'rejected' need one; without it both must be whole "
                            f"conversations, lists of messages)")
        for key, value in (("chosen", chosen), ("rejected", rejected)):
            if not isinstance(value, str):
                raise DataError(f"{where}: {key!r} must be a string, as 'prompt' is (or "
                                f"all three lists of messages)")
        prompt = system_message(obj, where) + [{"role": "user", "content": prompt}]
        chosen = [{"role": "assistant", "content": chosen}]
        rejected = [{"role": "assistant", "content": rejected}]
    elif prompt is None:
        prompt, chosen, rejected = _split_shared_prefix(chosen, rejected, where)
    for key, value in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
        if not isinstance(value, list) or not value:
            raise DataError(f"{where}: {key!r} must be a non-empty list of messages")
    for side, completion in (("chosen", chosen), ("rejected", rejected)):
        last = completion[-1]
        if not isinstance(last, dict) or last.get("role") != "assistant":
            raise DataError(f"{where}: {side!r} must end with an assistant message")
        checked_messages(prompt + completion, where, _message_names(len(prompt), side))
    return prompt, chosen, rejected


def _message_names(prompt_len: int, side: str):
    """Message i of prompt + completion, named by its own field: "'prompt' message 2",
    "'chosen' message 1"."""
    return lambda i: (f"'prompt' message {i}" if i <= prompt_len else
                      f"{side!r} message {i - prompt_len}")


def empty_completion(chosen: list[dict], rejected: list[dict]) -> bool:
    """Whether a side's completion is empty or blank (SFT's rule for an answer): the
    pair would teach the model to prefer, or to avoid, saying nothing."""
    return empty_answer(chosen) or empty_answer(rejected)


def check_some_pair(field: str, path) -> None:
    """Refuses (before a run writes anything) a preference file that is missing, or
    whose first records are bad, or whose every pair has an empty completion. Reads up to
    the first pair with both completions (usually one line); the rest are read when the
    pairs are tokenized."""
    if not Path(path).is_file():
        raise DataError(f"{field}: {path}: no such file (preference data is JSON Lines)")
    records = 0
    for n, obj in iter_jsonl(Path(path)):
        records += 1
        _, chosen, rejected = record_pair(obj, f"{path}:{n}")
        if not empty_completion(chosen, rejected):
            return
    if not records:
        raise DataError(f"{field}: {path}: no records")
    raise DataError(f"{field}: {path}: {_all_empty(records)}")


def _all_empty(pairs: int) -> str:
    return (f"every pair has an empty chosen or rejected completion ({pairs} pairs): "
            f"nothing to train on")


def _split_shared_prefix(chosen, rejected, where: str):
    if not (isinstance(chosen, list) and isinstance(rejected, list)):
        raise DataError(f"{where}: without 'prompt', 'chosen' and 'rejected' must be whole "
                        f"conversations (lists of messages)")
    shared = 0
    while (shared < min(len(chosen), len(rejected)) - 1
           and chosen[shared] == rejected[shared]):
        shared += 1
    if shared == 0:
        raise DataError(f"{where}: 'chosen' and 'rejected' share no prompt message")
    return chosen[:shared], chosen[shared:], rejected[shared:]


# ------------------------------------------------------------------------ tokenizing

def tokenize_pairs(path: Path, template, tok, out_dir: Path) -> None:
    """Writes ``tokens`` (two documents per pair: chosen, then rejected), ``trained``
    (their completion flags) and ``first_trained.npy`` (per sequence: the index of its
    first completion token, -1 if none, ``EMPTY_COMPLETION`` for both sides of a pair
    with an empty completion, else ``SAME_COMPLETIONS`` for both sides of a pair whose
    completions are the same)."""
    dtype = token_dtype(tok.vocab_size)
    first: list[int] = []
    with IndexedDatasetWriter(out_dir / "tokens", dtype) as tokens, \
            IndexedDatasetWriter(out_dir / "trained", np.uint8) as trained:
        for n, obj in iter_jsonl(path):
            where = f"{path}:{n}"
            prompt, chosen, rejected = record_pair(obj, where)
            prompt_ids = template.prompt_ids(prompt, tok)
            mark = (EMPTY_COMPLETION if empty_completion(chosen, rejected) else
                    SAME_COMPLETIONS if chosen == rejected else None)
            for completion in (chosen, rejected):
                ids, flags = template.encode(prompt + completion, tok, where)
                start = _divergence(ids, prompt_ids)
                flags = flags & (np.arange(len(ids)) >= max(start, 1))
                tokens.add_document(ids)
                trained.add_document(flags.astype(np.uint8))
                hits = np.flatnonzero(flags)
                first.append(mark if mark is not None else int(hits[0]) if len(hits) else -1)
    save_npy(out_dir / "first_trained.npy", np.asarray(first, dtype=np.int64))


def _divergence(ids: np.ndarray, prompt_ids: list[int]) -> int:
    """Where the completion starts: the prompt's length, or where the tokens of the
    whole sequence stop matching the prompt's alone."""
    n = min(len(ids), len(prompt_ids))
    differs = np.flatnonzero(ids[:n] != np.asarray(prompt_ids[:n], dtype=ids.dtype))
    return int(differs[0]) if len(differs) else n


# -------------------------------------------------------------------------- dataset

class PreferenceDataset(PlannedRows):
    """The never-ending stream of preference pairs (or of packed rows of pairs): epoch
    ``e`` shuffles them with ``(seed, e)``; ``batch(ks)`` is the pairs of stream items
    ``ks`` as one batch (see the module doc). ``holdout``: (part, eval_fraction)."""

    _ORDER = 5  # rng purpose
    # (records, 2) reference log-probabilities, chosen and rejected, once a precomputed
    # pass has run (train.reference); None: batches carry none
    reference: Optional[np.ndarray] = None

    def __init__(self, path: str | Path, tokenizer, template: str, seq_len: int,
                 max_prompt_len: Optional[int] = None, seed: int = 0, pack: bool = False,
                 cache_dir: Optional[Path] = None, holdout: Optional[tuple[str, float]] = None,
                 pad_to_multiple_of: Optional[int] = None):
        self.path = Path(path)
        if not self.path.is_file():
            raise DataError(f"data.path: {self.path}: no such file (preference data is "
                            f"JSON Lines)")
        self.template = get_template(template, tokenizer)
        self.seq_len, self.seed, self.pack = int(seq_len), int(seed), bool(pack)
        self.max_prompt_len = max_prompt_len
        self.pad_to_multiple_of = None if pack else pad_to_multiple_of
        self.pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else 0
        self.cache, self.tokens, self.trained = tokenized(
            self.path, "preference", PREFERENCE_CACHE_VERSION, self.template, tokenizer,
            cache_dir, tokenize_pairs)
        self._measure(np.load(self.cache / "first_trained.npy").reshape(-1, 2), holdout)
        self._start_stream()

    # ------------------------------------------------------------------ what is kept

    def _measure(self, first: np.ndarray, holdout) -> None:
        """Which pairs train (``rows``), each sequence's prompt cut (``cut``) and kept
        length, and the counts the run reports."""
        lengths = self.tokens.sequence_lengths.astype(np.int64).reshape(-1, 2)
        completion = np.where(first > 0, first, lengths)  # the prompt's length, per side
        mpl = self.max_prompt_len
        self.cut = np.maximum(completion - mpl, 0) if mpl else np.zeros_like(completion)
        kept = np.minimum(lengths - self.cut, self.seq_len + 1)
        ids = np.arange(len(first))
        which = ""
        if holdout is not None:
            part, fraction = holdout
            ids = split_documents(len(first), fraction, part)
            which = f" ({'held-out' if part == 'eval' else 'training'} pairs)"
            if len(ids) in (0, len(first)):
                raise DataError(f"{self.path}: too few pairs ({len(first)}) to hold out "
                                f"data.eval_fraction={fraction} of them and train on the rest")
        same = (first[ids] == SAME_COMPLETIONS).all(axis=1)
        empty = (first[ids] == EMPTY_COMPLETION).all(axis=1)
        fits = ((first[ids] >= 1) & (first[ids] - self.cut[ids] < kept[ids])).all(axis=1)
        self.rows = ids[fits]  # (a marked pair has no first token >= 1)
        self.sizes = (kept - 1).sum(axis=1)  # positions a pair fills, both sides
        self._kept = kept
        self.same_completions, self.empty_completions = int(same.sum()), int(empty.sum())
        self.skipped_pairs = int((~fits & ~same & ~empty).sum())
        rows = self.rows
        self.truncated_prompts = int((self.cut[rows] > 0).any(axis=1).sum())
        self.truncated_completions = int((lengths[rows] - self.cut[rows]
                                          > self.seq_len + 1).any(axis=1).sum())
        if self.empty_completions == len(ids):
            raise DataError(f"{self.path}{which}: {_all_empty(len(ids))}")
        if not len(rows):
            raise DataError(f"{self.path}{which}: no pair keeps a completion token within "
                            f"data.seq_len + 1 = {self.seq_len + 1} tokens "
                            f"({self.same_completions} with the same completions, "
                            f"{self.empty_completions} with an empty one)")
        if self.same_completions or self.skipped_pairs or self.empty_completions:
            warnings.warn(f"{self.path}{which}: {self.same_completions} pairs skipped for "
                          f"the same chosen and rejected completion, "
                          f"{self.empty_completions} for an empty one, {self.skipped_pairs} "
                          f"for no completion token within data.seq_len", stacklevel=3)

    @property
    def num_tokens(self) -> int:
        return int(self._kept[self.rows].sum())

    def fingerprint(self) -> list:
        return [len(self.rows), int(self.tokens.num_tokens)]

    # --------------------------------------------------------------------- the stream

    def _build_epoch_plan(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        order = self.rows[rng_for(self.seed, epoch, self._ORDER).permutation(len(self.rows))]
        if self.pack:
            return pack_first_fit(order, self.sizes, 2 * self.seq_len)
        return np.arange(len(order) + 1), order

    def sequence(self, pair: int, side: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, completion flags) of one side (0 chosen, 1 rejected), as trained: the
        prompt cut from the left, the whole cut to seq_len + 1 tokens."""
        doc, cut = 2 * pair + side, int(self.cut[pair, side])
        end = cut + self.seq_len + 1
        return (self.tokens[doc][cut:end].astype(np.int64),
                self.trained[doc][cut:end].astype(bool))

    def __getitem__(self, k: int) -> dict:
        return self.batch([k])

    def batch(self, ks: list[int]) -> dict:
        pairs = [p for k in ks for p in self.samples_of(k)]
        if not self.pack:
            return self.pair_batch(pairs)
        return self._finish([self._packed_row(self.samples_of(k), pairs) for k in ks], pairs)

    def pair_batch(self, pairs: list[int]) -> dict:
        """Pairs ``pairs`` (record ids) as one batch of padded rows."""
        return self._finish(self._padded_rows(pairs), pairs)

    def _finish(self, rows: list[dict], pairs: list[int]) -> dict:
        out = collate(rows, pairs)
        out["slots"] = torch.from_numpy(np.stack([r["slots"] for r in rows]))
        out["n_pairs"] = len(pairs)
        if self.reference is not None:  # train.reference=precomputed, chosen then rejected
            out["ref_logps"] = torch.from_numpy(np.concatenate(
                [self.reference[pairs, 0], self.reference[pairs, 1]]).astype(np.float32))
        return out

    def _padded_rows(self, pairs: list[int]) -> list[dict]:
        """Chosen rows, then rejected ones, padded to the longest (rounded up)."""
        sequences = [self.sequence(p, side) for side in (0, 1) for p in pairs]
        width = max(len(ids) - 1 for ids, _ in sequences)
        m = self.pad_to_multiple_of
        width = min(-(-width // m) * m, self.seq_len) if m else self.seq_len
        rows = []
        for slot, sample in enumerate(sequences):
            row = sft_row([sample], self.seq_len, self.pad_id, False, width)
            row["slots"] = np.where(row["labels"] >= 0, slot, -1)
            rows.append(row)
        return rows

    def _packed_row(self, row_pairs: list[int], batch_pairs: list[int]) -> dict:
        """Both sides of ``row_pairs`` in one row of 2 x seq_len positions; slot of pair
        i of the batch: i chosen, n + i rejected."""
        n = len(batch_pairs)
        samples, slots = [], []
        for p in row_pairs:
            i = batch_pairs.index(p)
            for side in (0, 1):
                samples.append(self.sequence(p, side))
                slots.append(i + side * n)
        row = sft_row(samples, 2 * self.seq_len, self.pad_id, True)
        segment_slot = np.append(np.asarray(slots, dtype=np.int64), -1)  # padding: -1
        row["slots"] = np.where(row["labels"] >= 0, segment_slot[row["segments"]], -1)
        return row

    def report(self) -> tuple[list[str], dict]:
        """The notes and counts a run prints and records about its pairs."""
        stats = {"preference_pairs": len(self.rows),
                 "preference_truncated_prompts": self.truncated_prompts,
                 "preference_truncated_completions": self.truncated_completions,
                 "preference_skipped_pairs": self.skipped_pairs,
                 "preference_same_completions": self.same_completions,
                 "preference_empty_completions": self.empty_completions}
        notes = [f"preference: {len(self.rows):,} pairs; {self.truncated_prompts:,} prompts "
                 f"cut to data.max_prompt_len, {self.truncated_completions:,} pairs cut to "
                 f"data.seq_len + 1 tokens; skipped: {self.skipped_pairs:,} with no "
                 f"completion token left, {self.same_completions:,} with the same chosen and "
                 f"rejected, {self.empty_completions:,} with an empty chosen or rejected"]
        return notes, stats
