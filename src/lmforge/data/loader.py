"""Batches for the trainer (``data.kind`` pretrain | sft) and for ``lmforge eval``.

``build_dataset_loader`` returns a ``BatchLoader`` whose ``next_batch()`` gives this
rank's next micro-batch, forever (epochs roll over with a new shuffle)::

    input_ids  LongTensor (micro_batch, seq)
    labels     LongTensor (micro_batch, seq), -100 where there is no target
    positions  LongTensor (micro_batch, seq)         } with document masking or
    mask       BoolTensor (micro_batch, 1, seq, seq) } SFT packing; True = may attend
    sample_ids LongTensor (micro_batch,): the rows' indices in the global sample stream

``seq`` is ``data.seq_len``, except for unpacked SFT batches: those are padded to their
longest sample rounded up to ``sft_pad_multiple(cfg)`` (so ranks and micro-batches may
differ in length; the loss is normalised by the step's valid tokens, see train/step.py).

Rank ``r``'s rows are a pure function of (data, seed, dp_rank, dp_size, consumed samples)
(see ``sampler.py``), and ``state_dict()`` is ``loader_state``: ``consumed_samples`` plus
checks, so a resumed run reads exactly the rows an uninterrupted one would (a batch's
length is a function of its rows). With ``data.num_workers > 0`` batches are built ahead
in worker processes; the state counts only the batches handed out.
"""
from __future__ import annotations

import itertools
import math
import warnings
from pathlib import Path
from typing import Iterable, Iterator, Optional

import numpy as np
import torch

from lmforge.config import samples_per_step
from lmforge.data.errors import DataError
from lmforge.data.indexed import IndexedDataset, exists, strip_suffix
from lmforge.data.pretrain import BlendedDataset, PretrainDataset, make_row
from lmforge.data.sampler import MicroBatchSampler
from lmforge.data.sft import SFTDataset, iter_jsonl, record_messages, sft_row
from lmforge.data.templates import get_template
from lmforge.data.tokenizer import read_text

STATE_VERSION = 1


def loader_state(consumed_samples: int, seed: int, micro_batch_size: int, dp_size: int,
                 data: Iterable[int], group_size: int = 0) -> dict:
    """The one schema of a training loader's resumable state (``BatchLoader`` and the
    text corpora's ``PackedTokenLoader``): its position, a count of samples all ranks
    together have consumed, and what ``resume_position`` checks it against
    (``group_size``: the samples per step SFT grouped by length, 0 if not)."""
    return {"version": STATE_VERSION, "consumed_samples": int(consumed_samples),
            "seed": int(seed), "micro_batch_size": int(micro_batch_size),
            "dp_size": int(dp_size), "data": [int(n) for n in data],
            "group_size": int(group_size)}


def resume_position(state: dict, seed: int, data: Iterable[int], group_size: int = 0) -> int:
    """``consumed_samples`` of a ``loader_state``, refused when saved with another seed
    (the sample order would differ); other data (sizes ``data``), or another grouping by
    length, only warn."""
    if int(state.get("seed", seed)) != seed:
        raise DataError(f"loader state: saved with train.seed={state['seed']}, this run "
                        f"has {seed}; the sample order would differ")
    if "data" in state and list(state["data"]) != list(data):
        warnings.warn(f"loader state: the data differ from the checkpoint's (sizes "
                      f"{state['data']} vs {list(data)}); resuming at the same sample "
                      "count anyway", stacklevel=3)
    if int(state.get("group_size", 0)) != group_size:
        warnings.warn(f"loader state: saved grouping samples by length in steps of "
                      f"{state.get('group_size', 0)}, this run {group_size} (0: not "
                      f"grouped; data.group_by_length, data.global_batch_size); until the "
                      f"epoch ends some samples are read twice and others not at all",
                      stacklevel=3)
    return int(state["consumed_samples"])


# --------------------------------------------------------------------------- collate

def block_causal_mask(segments: torch.Tensor) -> torch.Tensor:
    """(batch, seq) segment ids -> (batch, 1, seq, seq) bool: causal and same segment."""
    seq = segments.shape[-1]
    same = segments[:, :, None] == segments[:, None, :]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=segments.device).tril()
    return (same & causal)[:, None]


def collate(rows: list[dict], sample_ids: Iterable[int]) -> dict:
    """Row dicts of numpy arrays -> the batch dict of tensors."""
    batch = {"input_ids": torch.from_numpy(np.stack([r["input_ids"] for r in rows])),
             "labels": torch.from_numpy(np.stack([r["labels"] for r in rows]))}
    if "segments" in rows[0]:
        batch["positions"] = torch.from_numpy(np.stack([r["positions"] for r in rows]))
        batch["mask"] = block_causal_mask(torch.from_numpy(np.stack([r["segments"]
                                                                     for r in rows])))
    batch["sample_ids"] = torch.tensor(list(sample_ids), dtype=torch.long)
    return batch


# ---------------------------------------------------------------------------- loader

class _MicroBatches(torch.utils.data.Dataset):
    """Micro-step m -> this rank's collated batch (what DataLoader workers compute)."""

    def __init__(self, dataset, sampler: MicroBatchSampler):
        self.dataset, self.sampler = dataset, sampler

    def __getitem__(self, micro_step: int) -> dict:
        ids = self.sampler.indices(micro_step)
        batch_rows = getattr(self.dataset, "batch_rows", None)  # SFT: padded per batch
        return collate(batch_rows(ids) if batch_rows else [self.dataset[k] for k in ids], ids)


class _CountFrom:
    def __init__(self, start: int):
        self.start = start

    def __iter__(self):
        return itertools.count(self.start)


class BatchLoader:
    """This rank's never-ending micro-batches over a sample stream."""

    def __init__(self, dataset, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 seed: int = 0, num_workers: int = 0):
        self.dataset = dataset
        self.sampler = MicroBatchSampler(micro_batch_size, dp_rank, dp_size)
        self.seed, self.num_workers = int(seed), int(num_workers)
        self._source = _MicroBatches(dataset, self.sampler)
        self._iter: Optional[Iterator] = None

    @property
    def consumed_samples(self) -> int:
        return self.sampler.consumed_samples

    def next_batch(self) -> dict:
        if self.num_workers == 0:
            return self._source[self._take()]
        if self._iter is None:
            loader = torch.utils.data.DataLoader(
                self._source, batch_size=None, sampler=_CountFrom(self.sampler.micro_step),
                num_workers=self.num_workers, prefetch_factor=2)
            self._iter = iter(loader)
        batch = next(self._iter)
        self._take()
        return batch

    def _take(self) -> int:
        step = self.sampler.micro_step
        self.sampler.micro_step += 1
        return step

    def __iter__(self):
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        return loader_state(self.consumed_samples, self.seed, self.sampler.micro_batch_size,
                            self.sampler.dp_size, self.dataset.fingerprint(), self._group_size)

    @property
    def _group_size(self) -> int:
        return getattr(self.dataset, "group_size", None) or 0

    def load_state_dict(self, state: dict) -> None:
        consumed = resume_position(state, self.seed, self.dataset.fingerprint(),
                                   self._group_size)
        self.close()
        self.sampler.consumed_samples = consumed

    def close(self) -> None:
        """Stops prefetching workers (they restart on the next ``next_batch``)."""
        self._iter = None


# ---------------------------------------------------------------------------- builders

def pretrain_sources(value, field: str) -> list[tuple[Optional[float], str]]:
    """``data.path``/``data.blend`` -> [(weight or None, prefix)].

    Accepts a prefix, a list of prefixes (weighted by their token counts, as if
    concatenated), ``[[weight, prefix], ...]`` or Megatron's flat ``[w, prefix, w, ...]``.
    """
    if isinstance(value, (str, Path)):
        return [(None, _prefix(value, field))]
    if not isinstance(value, (list, tuple)) or not value:
        raise DataError(f"{field}: expected a prefix, a list of prefixes or "
                        "[[weight, prefix], ...]")
    if all(isinstance(v, (str, Path)) for v in value) and not _is_number(value[0]):
        return [(None, _prefix(v, field)) for v in value]
    if all(isinstance(v, (list, tuple)) and len(v) == 2 for v in value):
        pairs = [tuple(v) for v in value]
    elif len(value) % 2 == 0:
        pairs = list(zip(value[0::2], value[1::2]))
    else:
        raise DataError(f"{field}: expected [[weight, prefix], ...]")
    out = []
    for w, p in pairs:
        if not _is_number(w) or float(w) <= 0:
            raise DataError(f"{field}: weight {w!r} for {p} must be a positive number")
        out.append((float(w), _prefix(p, field)))
    return out


def _is_number(v) -> bool:
    try:
        float(v)
        return not isinstance(v, bool)
    except (TypeError, ValueError):
        return False


def _prefix(value, field: str) -> str:
    prefix = strip_suffix(str(value))
    if not exists(prefix):
        raise DataError(f"{field}: {prefix}.bin/.idx not found (expected the prefix written "
                        "by lmforge preprocess)")
    return prefix


def build_pretrain_dataset(sources: list[tuple[Optional[float], str]], seq_len: int,
                           seed: int, document_mask: bool = False, pad_id: int = 0,
                           cache_dir: Optional[Path] = None,
                           holdout: Optional[tuple[str, float]] = None):
    """``holdout``: (part, eval_fraction), that part of each source (see PretrainDataset)."""
    datasets = [PretrainDataset(p, seq_len, seed, document_mask, pad_id, cache_dir, holdout)
                for _, p in sources]
    if len(datasets) == 1:
        return datasets[0]
    weights = [w if w is not None else float(d.num_tokens) for (w, _), d in
               zip(sources, datasets)]
    return BlendedDataset(datasets, weights)


def build_dataset_loader(cfg, tokenizer, dp_rank: int, dp_size: int, split: str = "train",
                         cache_dir: Optional[Path] = None, holdout: bool = False
                         ) -> BatchLoader:
    """The trainer's loader for ``data.kind`` pretrain or sft. ``holdout``: "train" reads
    the documents (pretrain) or samples (sft) of data.path (or data.blend) that
    ``data.eval_fraction`` does not hold out, and "eval" the held-out ones."""
    d = cfg.data
    if split not in ("train", "eval"):
        raise DataError(f"split: {split!r} is not train or eval")
    held = (split, d.eval_fraction) if holdout else None
    if split == "eval" and not holdout:
        if not d.eval_path:
            raise DataError(f"data.eval_path: not set (needed to evaluate kind {d.kind})")
        value, field = d.eval_path, "data.eval_path"
    elif d.blend and d.kind == "pretrain":
        value, field = d.blend, "data.blend"
    else:
        value, field = d.path, "data.path"
    if not value:
        raise DataError(f"{field}: required when data.kind is {d.kind}")
    seed = int(cfg.train.seed)
    pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else 0
    if d.kind == "pretrain":
        dataset = build_pretrain_dataset(pretrain_sources(value, field), d.seq_len, seed,
                                         d.document_mask, pad_id, cache_dir, held)
    elif d.kind == "sft":
        if isinstance(value, (list, tuple)):
            if len(value) != 1:
                raise DataError(f"{field}: sft takes one .jsonl file")
            value = value[0]
        group = samples_per_step(cfg, dp_size) if d.group_by_length and split == "train" \
            else None  # the held-out passes keep the plain order: the same samples score
        dataset = SFTDataset(value, tokenizer, d.template, d.seq_len, seed, d.pack, cache_dir,
                             held, sft_pad_multiple(cfg), group)
    else:
        raise DataError(f"data.kind: {d.kind!r} is not pretrain or sft")
    return BatchLoader(dataset, d.micro_batch_size, dp_rank, dp_size, seed, d.num_workers)


def sft_pad_multiple(cfg) -> Optional[int]:
    """What unpacked SFT batches are padded to a multiple of (their longest sample,
    rounded up), or None: every row data.seq_len wide. None under pipeline parallelism,
    whose stages are shaped once by the first step (every microbatch, every step must
    match), and with data.pad_to_multiple_of=0; a multiple of parallel.tp too, as
    sequence parallelism splits the sequence tp ways."""
    d, p = cfg.data, cfg.parallel
    if d.pack or not d.pad_to_multiple_of or p.pp > 1:
        return None
    return math.lcm(d.pad_to_multiple_of, p.tp)


# ------------------------------------------------------------------------------ eval

def iter_eval_batches(cfg, tokenizer, path, seq_len: int, batch_size: int,
                      json_key: Optional[str] = None) -> Iterator[dict]:
    """Every token of ``path`` once, in order, as batch dicts (the last ones may be
    smaller and padded). ``path``: a Megatron prefix (or its .bin/.idx), a .txt file (one
    document, see ``text_documents``), or a .jsonl file of ``{json_key: text}`` records
    (documents, windows of ``seq_len + 1`` over their concatenation with EOD) or of SFT
    samples (one padded row each, only the assistant tokens scored). ``json_key``: the
    records' text field (default: data.json_key, else "text")."""
    d = cfg.data if cfg is not None else None
    document_mask = bool(d and d.document_mask)
    pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else 0
    text = str(path)
    if exists(strip_suffix(text)):
        ds = IndexedDataset(strip_suffix(text))
        rows = windows((ds.document(i) for i in range(ds.num_documents)), seq_len,
                       document_mask, pad_id)
    elif text.endswith((".jsonl", ".jsonl.gz")):
        key = json_key or (cfg.data.json_key if cfg is not None else "text")
        rows = _jsonl_rows(Path(text), cfg, tokenizer, key, seq_len, document_mask, pad_id)
    elif text.endswith(".txt") and Path(text).is_file():
        rows = windows(text_documents([Path(text)], tokenizer), seq_len, document_mask, pad_id)
    else:
        raise DataError(f"{path}: not a PREFIX.bin/.idx pair, a .jsonl or a .txt file")
    yield from _batches(rows, batch_size)


def iter_text_eval_batches(files: list[Path], tokenizer, seq_len: int, batch_size: int
                           ) -> Iterator[dict]:
    """Every token of the text ``files`` once, in order (see ``text_documents``)."""
    pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else 0
    yield from _batches(windows(text_documents(files, tokenizer), seq_len, False, pad_id),
                        batch_size)


def text_documents(files: Iterable[Path], tokenizer) -> Iterator[np.ndarray]:
    """Each file as its tokenizer encodes it (with the special tokens it adds), an EOD
    between files and none after the last: one file scores as transformers scores its
    text."""
    for n, path in enumerate(files):
        between = tokenizer.eos_ids if n else []
        yield np.asarray(between + tokenizer.encode(read_text(path)), dtype=np.int64)


def _batches(rows: Iterator[dict], batch_size: int) -> Iterator[dict]:
    ids = itertools.count()
    while True:
        chunk = list(itertools.islice(rows, batch_size))
        if not chunk:
            return
        yield collate(chunk, itertools.islice(ids, len(chunk)))


def windows(docs: Iterable[np.ndarray], seq_len: int, document_mask: bool, pad_id: int
            ) -> Iterator[dict]:
    """Rows of ``seq_len + 1`` tokens over the concatenated documents, consecutive rows
    sharing one token (as in training); the last row is padded."""
    pieces: list[np.ndarray] = []
    filled = 0
    for doc in docs:
        doc = np.asarray(doc)
        offset, first = 0, True
        while offset < len(doc):
            take = min(len(doc) - offset, seq_len + 1 - filled)
            part = doc[offset:offset + take]
            if first or not pieces:
                pieces.append(part)
            else:  # the same document continues after a window break
                pieces[-1] = np.concatenate([pieces[-1], part])
            first = False
            filled += take
            offset += take
            if filled == seq_len + 1:
                yield make_row(pieces, seq_len, document_mask, pad_id)
                pieces, filled = [pieces[-1][-1:]], 1
    if filled > 1:
        yield make_row(pieces, seq_len, document_mask, pad_id)


def _jsonl_rows(path: Path, cfg, tokenizer, key: str, seq_len: int, document_mask: bool,
                pad_id: int) -> Iterator[dict]:
    records = iter_jsonl(path)
    first = next(records, None)
    if first is None:
        raise DataError(f"{path}: no records")
    records = itertools.chain([first], records)
    if isinstance(first[1], dict) and key not in first[1] and \
            ("messages" in first[1] or "prompt" in first[1]):
        template = get_template(cfg.data.template if cfg is not None else "auto", tokenizer)
        for n, obj in records:
            where = f"{path}:{n}"
            ids, trained = template.encode(record_messages(obj, where), tokenizer, where)
            if trained[1:seq_len + 1].any():
                yield sft_row([(ids, trained)], seq_len, pad_id, packed=False)
        return

    def docs():
        for n, obj in records:
            if not isinstance(obj, dict) or not isinstance(obj.get(key), str):
                raise DataError(f"{path}:{n}: no string key {key!r}")
            if obj[key].strip():
                yield np.asarray(tokenizer.encode(obj[key]) + tokenizer.eos_ids)

    yield from windows(docs(), seq_len, document_mask, pad_id)
