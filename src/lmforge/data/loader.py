"""The one loader: batches of any ``Dataset`` (``lmforge.data.dataset``; every
``data.kind``) for the trainer, its held-out evaluation and ``lmforge eval``.

``BatchLoader.next_batch()`` gives this rank's next micro-batch, forever (epochs roll over
with a new shuffle); ``held_out_batches(n)`` one pass over this rank's share of the first
``n`` micro-steps of the dataset's distinct samples (the same each time). A batch is the
dataset's collate (``ds.batch``) of the rows the sampler deals this rank, e.g.::

    input_ids  LongTensor (micro_batch, seq)
    labels     LongTensor (micro_batch, seq), -100 where there is no target
    positions  LongTensor (micro_batch, seq)  } with document masking or SFT packing:
    segments   LongTensor (micro_batch, seq)  } each position's document (models/attention)
    sample_ids LongTensor (micro_batch,): the rows' indices in the global sample stream

``seq`` is ``data.seq_len``, except for unpacked SFT batches: those are padded to their
longest sample rounded up to ``sft_pad_multiple(cfg)`` (so ranks and micro-batches may
differ in length; the loss is normalised by the step's valid tokens, see train/step.py).

``build_dataset_loader`` builds the loader of ``data.kind`` pretrain or sft (the text
corpora's is built in ``build``). Rank ``r``'s rows are a pure function of (data, seed,
dp_rank, dp_size, consumed samples) (see ``sampler.py``), and ``state_dict()`` is
``loader_state``: ``consumed_samples`` plus checks (and the dataset's own state, if it
has one), so a resumed run reads exactly the rows an uninterrupted one would (a batch's
length is a function of its rows). With ``data.num_workers > 0`` batches are built ahead
in worker processes; the state counts only the batches handed out.
"""
from __future__ import annotations

import itertools
import math
import sys
from pathlib import Path
from typing import Iterable, Iterator, Optional

import torch

from lmforge import IGNORE_INDEX
from lmforge.config import samples_per_step, show
from lmforge.data.dataset import Dataset
from lmforge.data.errors import DataError
from lmforge.data.indexed_files import exists, strip_suffix
from lmforge.data.pretrain import BlendedDataset, PretrainDataset
from lmforge.data.sampler import MicroBatchSampler
from lmforge.data.preference import PreferenceDataset
from lmforge.data.prompts import PromptDataset
from lmforge.data.sft import SFTDataset

STATE_VERSION = 1


def loader_state(consumed_samples: int, seed: int, micro_batch_size: int, dp_size: int,
                 data: Iterable[int], group_size: int = 0) -> dict:
    """The one schema of the loader's resumable state: its position, a count of samples all ranks
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
        _say(f"resume: the data differ from the checkpoint's (sizes "
             f"{show(state['data'])} vs {show(list(data))}); resuming at the same sample "
             "count anyway")
    if int(state.get("group_size", 0)) != group_size:
        _say(f"resume: the checkpoint grouped samples by length in steps of "
             f"{state.get('group_size', 0)}, this run {group_size} (0: not grouped; "
             f"data.group_by_length, data.global_batch_size); until the epoch ends some "
             f"samples are read twice and others not at all")
    return int(state["consumed_samples"])


def _say(message: str) -> None:
    """One plain line on stderr, from the first rank (every rank's loader says it)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- loader

class _MicroBatches(torch.utils.data.Dataset):
    """Micro-step m -> this rank's collated batch (what DataLoader workers compute)."""

    def __init__(self, dataset, sampler: MicroBatchSampler):
        self.dataset, self.sampler = dataset, sampler

    def __getitem__(self, micro_step: int) -> dict:
        return self.dataset.batch(self.sampler.indices(micro_step))


class _CountFrom:
    def __init__(self, start: int):
        self.start = start

    def __iter__(self):
        return itertools.count(self.start)


class BatchLoader:
    """This rank's micro-batches of ``dataset``: never-ending for training, one pass over
    the distinct samples for evaluation."""

    def __init__(self, dataset: Dataset, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1,
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

    def held_out_batches(self, max_batches: Optional[int] = None) -> Iterator[dict]:
        """This rank's batches of the first ``max_batches`` micro-steps (None: all) over
        the dataset's distinct samples, in stream order, each sample at most once; the
        training position is untouched. A row past the distinct samples is left out (it
        would score a sample twice); a rank left with none still gets a batch, with no
        targets, so every rank runs the same number of forward passes (FSDP's gathers
        are collective)."""
        distinct = self.dataset.distinct_samples
        steps = -(-distinct // self.sampler.samples_per_micro_step)
        if max_batches is not None:
            steps = min(steps, max_batches)
        for step in range(steps):
            ids = self.sampler.indices(step)
            kept = [k for k in ids if k < distinct]
            yield self.dataset.batch(kept) if kept else no_targets(self.dataset.batch(ids))

    def state_dict(self) -> dict:
        state = loader_state(self.consumed_samples, self.seed, self.sampler.micro_batch_size,
                             self.sampler.dp_size, self.dataset.fingerprint(),
                             self.dataset.group_size)
        own = self.dataset.state_dict()
        return state | {"dataset": own} if own else state

    def load_state_dict(self, state: dict) -> None:
        consumed = resume_position(state, self.seed, self.dataset.fingerprint(),
                                   self.dataset.group_size)
        self.close()
        self.sampler.consumed_samples = consumed
        if "dataset" in state:
            self.dataset.load_state_dict(state["dataset"])

    def close(self) -> None:
        """Stops prefetching workers (they restart on the next ``next_batch``)."""
        self._iter = None


def no_targets(batch: dict) -> dict:
    """``batch`` with every target dropped (each ``*labels`` tensor all IGNORE_INDEX)."""
    return {k: v.masked_fill(torch.ones_like(v, dtype=torch.bool), IGNORE_INDEX)
            if k.endswith("labels") else v for k, v in batch.items()}


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
            raise DataError(f"{field}: weight {show(w)} for {show(p)} must be a positive "
                            f"number")
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
        value = _one_file(value, field, d.kind)
        group = samples_per_step(cfg, dp_size) if d.group_by_length and split == "train" \
            else None  # the held-out passes keep the plain order: the same samples score
        dataset = SFTDataset(value, tokenizer, d.template, d.seq_len, seed, d.pack, cache_dir,
                             held, sft_pad_multiple(cfg), group)
    elif d.kind == "preference":
        dataset = PreferenceDataset(_one_file(value, field, d.kind), tokenizer, d.template,
                                    d.seq_len, d.max_prompt_len, seed, d.pack, cache_dir,
                                    held, sft_pad_multiple(cfg))
    elif d.kind == "prompts":  # (GRPO's rollout makes the rows: train/grpo.py)
        dataset = PromptDataset(_one_file(value, field, d.kind), tokenizer, d.template,
                                d.seq_len - cfg.rl.max_completion_length, seed, held)
    else:
        raise DataError(f"data.kind: {d.kind!r} is not pretrain, sft or preference")
    return BatchLoader(dataset, d.micro_batch_size, dp_rank, dp_size, seed, d.num_workers)


def _one_file(value, field: str, kind: str) -> str:
    if isinstance(value, (list, tuple)):
        if len(value) != 1:
            raise DataError(f"{field}: {kind} takes one .jsonl file")
        value = value[0]
    return value


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
