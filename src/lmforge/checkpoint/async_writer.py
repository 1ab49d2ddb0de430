"""Checkpoints that do not stall training: the state is staged in CPU memory and a
background thread writes it; rank 0 commits it once every rank is done."""
from __future__ import annotations

import shutil
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Optional

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from lmforge.checkpoint import directory
from lmforge.checkpoint.collective import (CAUGHT, QuietSingleProcess, agree, describe,
                                           distributed, group_rank, write_error)
from lmforge.checkpoint.state import (ModelParts, dcp_writer, persist_and_commit,
                                      save_checkpoint, stage_save)


class AsyncCheckpointer:
    """Checkpoints that do not stall training: ``save`` copies the state to CPU memory
    and returns; a background thread writes it. Call ``maybe_finalize()`` every step
    (commits a finished save on rank 0, never blocks) and ``wait()`` before exiting.

    Construct, ``save`` and ``wait`` on every rank (collectives; the constructor creates
    a gloo group of its own, so checkpoint traffic in the background never interleaves
    with training collectives). With ``use_async=False``, or where ``dcp.async_save`` is
    refused, saves synchronously."""

    def __init__(self, root: str | Path, *, keep_last: int = 0, process_group=None,
                 use_async: bool = True):
        self.root = Path(root)
        self.keep_last = keep_last
        self.use_async = use_async and hasattr(dcp, "async_save")
        self._pending: Optional[tuple[Future, Path, Path]] = None
        self._error: Optional[str] = None  # a failed save, raised at the next wait()
        self._pg = process_group
        if self._pg is None and distributed() and self.use_async:
            self._pg = dist.new_group(backend="gloo")

    @property
    def pending_step(self) -> Optional[int]:
        return directory.checkpoint_step(self._pending[2]) if self._pending else None

    def save(self, step: int, model: ModelParts, optimizers, extra: dict,
             rank_state: Optional[dict], config_dict: Optional[dict]) -> Optional[Path]:
        """Start a save (waiting first for the previous one). Returns the final path when
        the save was synchronous, None while it is in flight."""
        self.wait()
        if not self.use_async:
            return save_checkpoint(self.root, step, model, optimizers, extra, rank_state,
                                   config_dict, process_group=self._pg,
                                   keep_last=self.keep_last)
        state, tmp, final = stage_save(self.root, step, model, optimizers, extra,
                                       rank_state, config_dict, self._pg)
        try:
            with QuietSingleProcess():
                future = dcp.async_save(state, storage_writer=dcp_writer(tmp),
                                        process_group=self._pg, no_dist=not distributed())
        except (AssertionError, RuntimeError, NotImplementedError, TypeError) as e:
            # Raised before any collective (e.g. a group without a CPU backend): every
            # rank takes this branch alike.
            warnings.warn(f"asynchronous checkpointing unavailable ({describe(e)}); "
                          f"saving synchronously from now on")
            self.use_async = False
            return persist_and_commit(state, tmp, final, self._pg, self.keep_last)
        if not isinstance(future, Future):  # newer torch: AsyncSaveResponse
            future = future.upload_completion
        self._pending = (future, tmp, final)
        return None

    def maybe_finalize(self) -> Optional[Path]:
        """Commit the in-flight save if it has finished (never blocks, no collective);
        returns its path then. A failed save is warned about here and raised on every
        rank by the next ``save()`` or ``wait()``."""
        if self._pending is None or not self._pending[0].done():
            return None
        final = self._finish_pending()
        if self._error:
            warnings.warn(f"asynchronous checkpoint failed: {self._error}")
        return final

    def wait(self) -> Optional[Path]:
        """Collective: block until the in-flight save (if any) is written and committed.
        Raises ``CheckpointError`` on every rank when a save failed on any rank."""
        final = self._finish_pending() if self._pending is not None else None
        error, self._error = self._error, None
        agree(error, self._pg)
        return final

    def _finish_pending(self) -> Optional[Path]:
        future, tmp, final = self._pending
        self._pending = None
        error = None
        try:
            future.result()
        except CAUGHT as e:  # DCP raises the same failure on every rank
            error = write_error(tmp, e)
        if group_rank(self._pg) == 0:
            if error:
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                error = directory.commit_and_prune(tmp, final, self.keep_last)
        if error:
            self._error = self._error or error
            return None
        return final

    def close(self) -> None:
        self.wait()
