"""The reference model of DPO and IPO in a full-weight run: a frozen copy of the starting
weights (train.reference=live), or the log-probabilities of one pass over the pairs
before training (train.reference=precomputed), so that the run holds no second model.

The frozen copy is built as the policy is (``build_train_model``: the same weights,
layout and FSDP2 sharding, nothing trainable); a LoRA run needs neither, its reference
being its own model with the adapters off (``train.preference``).

The precomputed pass scores every pair of the training and held-out data with the
starting model, in the run's layout (each data-parallel rank its share, gathered), and
writes the (pairs, 2) float64 log-probabilities into the run directory
(``reference/PART-KEY.npy``, KEY a hash of what the values depend on: the tokens, which
pairs, how they are cut); a resumed run reads them back rather than scoring with its
trained weights. Batches then carry them as ``ref_logps``.

The arrays are checked like a checkpoint's files: ``reference/checksums.json`` (the
checkpoint manifest's format, ``checkpoint.integrity``) records each array's SHA-256 and
size, its shape and dtype, the data it scored and the starting model it came from.
Before anything is written (``check_reference``, from ``train.loop.check_job``) and
again as they are read, every recorded array must match its record and hold only finite
values, and must come from this run's starting model; otherwise the run is refused in
one line naming the file and saying to delete ``reference/``. The manifest is written
after its arrays, so it is the commit: an array it does not record (a pass killed before
its manifest, or one from before manifests) is scored again, never trusted.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from lmforge.checkpoint.collective import describe
from lmforge.checkpoint.integrity import ALGORITHM, MANIFEST_NAME, file_digest, read_manifest
from lmforge.fsio import atomic_file, atomic_write_bytes
from lmforge.models.preference import NEEDS_REFERENCE, sequence_logps
from lmforge.train.model_setup import TrainModel, build_train_model
from lmforge.train.preference import Preference
from lmforge.train.progress import duration

REFERENCE_DIR = "reference"
DTYPE = np.dtype(np.float64)
PARTS = {"train": "training", "eval": "held-out"}  # a loader's name -> its pairs, in words
LINE_EVERY_S = 30.0  # without a bar, a line at least this often (and every tenth)


class ReferenceFileError(ValueError):
    """A precomputed reference that cannot be trusted: one line naming the file, what is
    wrong with it and what to do."""


def attach_reference_model(tm: TrainModel, job, device, dims, param_dtype=None) -> None:
    """Gives a full-weight live run's objective its frozen copy of the starting weights."""
    objective = tm.objective  # (a preference loss's, or GRPO's with rl.beta > 0)
    if getattr(objective, "reference", None) != "model":
        return
    reference = build_train_model(job, device, dims, param_dtype)
    for p in reference.parameters():
        p.requires_grad_(False)
    reference.train(False)
    objective.reference_model = reference.parts[0]


# ------------------------------------------------------------------ checking

def check_reference(job) -> None:
    """Refuses, before a run writes anything, a ``reference/`` whose recorded arrays do
    not verify (see the module doc). Nothing to check when the run precomputes no
    reference, or when train.overwrite=true is about to remove the earlier run's."""
    cfg = job.config
    if job.objective not in NEEDS_REFERENCE or cfg.train.reference != "precomputed":
        return
    if cfg.train.overwrite and not cfg.train.resume:
        return
    read_reference(Path(cfg.train.output_dir) / REFERENCE_DIR, starting_model(cfg))


def starting_model(cfg) -> dict:
    """The config keys that say which weights the pass scores with: the model section
    (a directory by its absolute path: hashing a multi-GB model at every start would cost
    more than it guards), and for a random start its seed. Not model.attention: sdpa and
    flex compute the same function."""
    model = dataclasses.asdict(cfg.model)
    model.pop("attention", None)
    for key in ("init_from", "tokenizer"):
        if model.get(key):
            model[key] = str(Path(model[key]).expanduser().resolve())
    out = {f"model.{k}": v for k, v in model.items()}
    if not model.get("init_from"):
        out["train.seed"] = cfg.train.seed
    return out


def read_reference(directory: Path, model: dict) -> dict[str, dict]:
    """``{array name: its manifest entry}`` of ``directory``, each array verified; {} when
    nothing is recorded. Raises ``ReferenceFileError`` at the first problem."""
    manifest = directory / MANIFEST_NAME
    if not manifest.is_file():
        return {}
    try:
        files = read_manifest(directory) or {}
    except (OSError, ValueError) as e:
        raise _refused(directory, manifest, f"unreadable ({_short(describe(e))})") from None
    for name, entry in sorted(files.items()):
        problem = _array_problem(directory / name, entry)
        if problem:
            raise _refused(directory, directory / name, problem)
        # A model mismatch is refused, not recomputed: the steps already taken minimised
        # a loss against these values, and scoring again with other weights would change
        # the objective in the middle of a run (as a dpo -> ipo switch would). Deleting
        # reference/ is the user's call; it costs one pass over the data.
        for key in sorted(set(entry.get("model") or {}) | set(model)):
            was, now = (entry.get("model") or {}).get(key), model.get(key)
            if was != now:
                raise ReferenceFileError(
                    f"{manifest}: the reference was computed from {key}={_short(was)}, this "
                    f"run starts from {key}={_short(now)}; a run keeps the reference it "
                    f"started with: set {key} back, or delete {directory} to recompute it")
    return files


def _array_problem(path: Path, entry: dict) -> Optional[str]:
    """What is wrong with one recorded array, or None."""
    if not path.exists() and not path.is_symlink():
        return f"missing (recorded in {path.parent / MANIFEST_NAME})"
    if not path.is_file():
        return "not a regular file"
    try:
        found = file_digest(path)
    except OSError as e:
        return f"unreadable ({describe(e)})"
    if found["bytes"] != entry.get("bytes"):
        how = "cut short" if found["bytes"] < (entry.get("bytes") or 0) else "grown"
        return f"{found['bytes']} bytes, {entry.get('bytes')} recorded ({how})"
    if found[ALGORITHM] != entry.get(ALGORITHM):
        return "checksum mismatch (changed since the reference pass wrote it)"
    try:
        values = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        return f"not a NumPy array ({_short(describe(e))})"
    shape, recorded = list(values.shape), entry.get("shape")
    if shape != recorded:
        return f"shape {tuple(shape)}, the manifest records {_shape(recorded)}"
    if str(values.dtype) != entry.get("dtype"):
        return f"dtype {values.dtype}, the manifest records {_short(entry.get('dtype'))}"
    if values.ndim != 2 or values.shape[1] != 2 or values.dtype != DTYPE:
        return f"{values.dtype} {tuple(shape)}: a reference is (pairs, 2) {DTYPE}"
    bad = int((~np.isfinite(values)).sum())
    if bad:
        return f"{bad} NaN/Inf log-probabilities"
    return None


def _refused(directory: Path, path: Path, problem: str) -> ReferenceFileError:
    return ReferenceFileError(f"{path}: {problem}; delete {directory} to recompute it from "
                              f"the starting model (train.reference=precomputed)")


def _shape(value) -> str:
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return str(tuple(value))
    return _short(value)


def _short(value, limit: int = 120) -> str:
    text = str(value)
    return text if len(text) <= limit else text[:limit] + "..."


# ------------------------------------------------------------------ the pass

def precompute_reference(tm: TrainModel, cfg, loaders: dict, out_dir: Path, device,
                         autocast, is_logging_rank: bool) -> None:
    """Scores the pairs of each loader's dataset (``{"train": loader, "eval": ...}``)
    with the model as it is now (before the first step), or reads an earlier pass from
    ``out_dir/reference``; sets each dataset's ``reference`` array."""
    objective = tm.objective
    if not isinstance(objective, Preference) or objective.reference != "batch":
        return
    directory = out_dir / REFERENCE_DIR
    model = starting_model(cfg)
    recorded = read_reference(directory, model)  # again: it may have changed since
    say = print if is_logging_rank else (lambda *a, **k: None)
    for part, loader in loaders.items():
        if loader is None:
            continue
        dataset = loader.dataset
        name = f"{part}-{data_key(dataset)}.npy"
        path = directory / name
        if name in recorded:
            say(f"reference: {len(dataset.rows):,} {PARTS[part]} pairs scored before, read "
                f"from {path}", flush=True)
            values = np.load(path, allow_pickle=False)
        else:
            values = _score(tm, dataset, loader, device, autocast,
                            _PassProgress(cfg, is_logging_rank, PARTS[part], len(dataset.rows),
                                          loader.sampler.micro_batch_size))
            bad = int((~np.isfinite(values[dataset.rows])).sum())
            if bad:
                start = (f"model.init_from={cfg.model.init_from}" if cfg.model.init_from
                         else f"model (a random start, train.seed={cfg.train.seed})")
                raise ValueError(f"{start}: the starting model gives {bad} NaN/Inf reference "
                                 f"log-probabilities on the {PARTS[part]} pairs of "
                                 f"{dataset.path}; nothing written to {directory}")
            if is_logging_rank:
                recorded[name] = _write(directory, name, values, recorded, model, dataset)
                say(f"reference: written to {path}", flush=True)
            if dist.is_initialized():
                dist.barrier()
        _check_fits(values, dataset, directory, path)
        dataset.reference = values


def data_key(dataset) -> str:
    """What the stored log-probabilities depend on besides the model: the tokens (the
    data cache's key: the file's content, template, tokenizer), which pairs are scored,
    and how they are cut. Counts alone are not enough: swapping every chosen and rejected
    answer keeps them all."""
    rows = np.ascontiguousarray(dataset.rows, dtype=np.int64)
    h = hashlib.sha256(json.dumps([dataset.cache.name, dataset.seq_len,
                                   dataset.max_prompt_len or 0]).encode())
    h.update(rows.tobytes())
    return h.hexdigest()[:16]


def _write(directory: Path, name: str, values: np.ndarray, recorded: dict, model: dict,
           dataset) -> dict:
    """The array, then the manifest that records it (atomically, in that order); returns
    its entry. Arrays no manifest records are removed: nothing vouches for them."""
    directory.mkdir(parents=True, exist_ok=True)
    with atomic_file(directory / name) as f:
        np.save(f, values.astype(DTYPE, copy=False))
    entry = {**file_digest(directory / name), "shape": list(values.shape),
             "dtype": str(DTYPE), "model": model,
             "data": {"path": str(dataset.path), "tokens": dataset.cache.name,
                      "pairs": int(len(dataset.rows)), "seq_len": dataset.seq_len,
                      "max_prompt_len": dataset.max_prompt_len}}
    files = {**recorded, name: entry}
    manifest = {"algorithm": ALGORITHM, "files": dict(sorted(files.items()))}
    atomic_write_bytes(directory / MANIFEST_NAME,
                       (json.dumps(manifest, indent=1) + "\n").encode())
    for stale in directory.glob("*.npy"):
        if stale.name not in files and stale.is_file() and not stale.is_symlink():
            stale.unlink()
    return entry


def _check_fits(values: np.ndarray, dataset, directory: Path, path: Path) -> None:
    """Every pair the run trains on has its row (the key makes this so; a forged array and
    manifest that agree would otherwise be an IndexError at some later step)."""
    need = int(dataset.rows.max()) + 1
    if values.ndim != 2 or values.shape[0] < need or values.shape[1] != 2:
        raise _refused(directory, path, f"shape {values.shape}, the data's pairs need "
                                        f"({need}, 2) or more rows")


class _PassProgress:
    """The pass's progress on the logging rank, as the training steps show theirs: a bar
    on a terminal (train.progress_bar), else a line every tenth of the pass or every
    ``LINE_EVERY_S`` seconds, with elapsed time and ETA."""

    def __init__(self, cfg, enabled: bool, what: str, pairs: int, batch: int):
        self.enabled, self.pairs = enabled, pairs
        self.started = self.last = time.perf_counter()
        self.step = max(1, -(-pairs // batch) // 10)  # batches between lines
        self.bar = None
        if enabled:
            print(f"reference: scoring {pairs:,} {what} pairs with the starting model "
                  f"(train.reference=precomputed), {batch} per batch per rank", flush=True)
            show = cfg.train.progress_bar
            if show is None:
                show = sys.stderr.isatty()
            if show:
                from tqdm import tqdm  # only when a bar is shown

                self.bar = tqdm(total=pairs, unit="pair", desc="reference", dynamic_ncols=True)

    def update(self, batches: int, done: int) -> None:
        """``batches`` forward passes on each rank, ``done`` pairs scored by all."""
        if not self.enabled:
            return
        done = min(done, self.pairs)
        if self.bar is not None:
            self.bar.update(done - self.bar.n)
            if done >= self.pairs:
                self.bar.close()
            return
        now = time.perf_counter()
        if done < self.pairs and batches % self.step and now - self.last < LINE_EVERY_S:
            return
        self.last, elapsed = now, now - self.started
        eta = elapsed / done * (self.pairs - done) if done else None
        print(f"reference: {done:,}/{self.pairs:,} pairs  elapsed {duration(elapsed)}  "
              f"ETA {duration(eta)}", flush=True)


@torch.no_grad()
def _score(tm: TrainModel, dataset, loader, device, autocast,
           progress: Optional[_PassProgress] = None) -> np.ndarray:
    """(pairs, 2) reference log-probabilities of every pair in ``dataset.rows``, each
    data-parallel rank scoring a strided share and the shares summed."""
    model = tm.parts[0]
    was_training = model.training
    model.eval()
    pairs = dataset.rows
    values = torch.zeros(int(pairs.max()) + 1, 2, dtype=torch.float64, device=device)
    size = loader.sampler.micro_batch_size
    rank, world = tm.dims.dp_rank, tm.dims.dp
    chunks = [pairs[i:i + size] for i in range(0, len(pairs), size)]
    # Every rank runs as many forward passes (FSDP2 gathers collectively): a rank with
    # no chunk left scores its last one again and keeps nothing of it.
    steps = -(-len(chunks) // world)
    for step in range(steps):
        index = step * world + rank
        chunk = chunks[min(index, len(chunks) - 1)]
        logps = sequence_logps(model, dataset.pair_batch(chunk.tolist()), device, autocast,
                               tm.loss_chunk_tokens)
        if index < len(chunks):
            values[torch.as_tensor(chunk, device=device), 0] = logps.chosen.double()
            values[torch.as_tensor(chunk, device=device), 1] = logps.rejected.double()
        if progress is not None:
            progress.update(step + 1, (step + 1) * world * size)
    if tm.dims.mesh is not None and world > 1:
        dist.all_reduce(values, group=tm.dims.group("dp"))
    model.train(was_training)
    return values.cpu().numpy()
