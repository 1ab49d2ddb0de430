"""The reference model of DPO and IPO in a full-weight run: a frozen copy of the starting
weights (train.reference=live), or the log-probabilities of one pass over the pairs
before training (train.reference=precomputed), so that the run holds no second model.

The frozen copy is built as the policy is (``build_train_model``: the same weights,
layout and FSDP2 sharding, nothing trainable); a LoRA run needs neither, its reference
being its own model with the adapters off (``train.preference``).

The precomputed pass scores every pair of the training and held-out data with the
starting model, in the run's layout (each data-parallel rank its share, gathered), and
writes the (pairs, 2) log-probabilities into the run directory (``reference/``), keyed by
the data's fingerprint: a resumed run reads them back rather than scoring with its
trained weights. Batches then carry them as ``ref_logps``.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from lmforge.fsio import atomic_file
from lmforge.train.model_setup import TrainModel, build_train_model
from lmforge.models.preference import sequence_logps
from lmforge.train.preference import Preference

REFERENCE_DIR = "reference"


def attach_reference_model(tm: TrainModel, job, device, dims, param_dtype=None) -> None:
    """Gives a full-weight live run's objective its frozen copy of the starting weights."""
    objective = tm.objective
    if not isinstance(objective, Preference) or objective.reference != "model":
        return
    reference = build_train_model(job, device, dims, param_dtype)
    for p in reference.parameters():
        p.requires_grad_(False)
    reference.train(False)
    objective.reference_model = reference.parts[0]


def precompute_reference(tm: TrainModel, loaders: dict, out_dir: Path, device,
                         autocast, is_logging_rank: bool) -> None:
    """Scores the pairs of each loader's dataset (``{"train": loader, "eval": ...}``)
    with the model as it is now (before the first step), or reads an earlier pass from
    ``out_dir/reference``; sets each dataset's ``reference`` array."""
    objective = tm.objective
    if not isinstance(objective, Preference) or objective.reference != "batch":
        return
    for name, loader in loaders.items():
        if loader is None:
            continue
        dataset = loader.dataset
        path = out_dir / REFERENCE_DIR / f"{name}-{_key(dataset)}.npy"
        if not path.is_file():
            values = _score(tm, dataset, loader, device, autocast)
            if is_logging_rank:
                path.parent.mkdir(parents=True, exist_ok=True)
                with atomic_file(path) as tmp:
                    np.save(tmp, values)
            if dist.is_initialized():
                dist.barrier()
        dataset.reference = np.load(path)


def _key(dataset) -> str:
    """What the stored log-probabilities depend on: the pairs and how they are cut."""
    return "-".join(str(v) for v in (*dataset.fingerprint(), dataset.seq_len,
                                     dataset.max_prompt_len or 0))


@torch.no_grad()
def _score(tm: TrainModel, dataset, loader, device, autocast) -> np.ndarray:
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
    if tm.dims.mesh is not None and world > 1:
        dist.all_reduce(values, group=tm.dims.group("dp"))
    model.train(was_training)
    return values.cpu().numpy()
