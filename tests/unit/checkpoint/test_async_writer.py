"""Asynchronous checkpoints: training goes on while a save is written; failures surface
on the next wait or save; the synchronous fallback."""
from __future__ import annotations

import errno
import os
import time

import pytest
import torch
from helpers.tiny_checkpoints import assert_loads, make_model, steps, weights

from lmforge.checkpoint import AsyncCheckpointer, CheckpointError, capture_rng


def test_async_save_writes_the_state_as_it_was_when_save_returned(tmp_path):
    model, optimizer = make_model()
    checkpointer = AsyncCheckpointer(tmp_path, keep_last=2)
    saved = {}
    for step in (1, 2, 3):
        with torch.no_grad():
            model.norm.weight.add_(1)
        assert checkpointer.save(step, model, optimizer, {"step": step}, capture_rng(),
                                 None) is None or not checkpointer.use_async
        saved[step] = weights(model)
        # Training goes on while the write runs: the staged copy must not see this.
        with torch.no_grad():
            model.norm.weight.add_(100)
        checkpointer.maybe_finalize()
    assert checkpointer.wait() in (None, tmp_path / "step-0000003")
    assert checkpointer.wait() is None  # nothing pending any more
    assert steps(tmp_path) == [2, 3]
    extra = assert_loads(tmp_path / "step-0000003", saved[3])
    assert extra == {"step": 3}
    assert_loads(tmp_path / "step-0000002", saved[2])


def test_async_maybe_finalize_commits_without_wait(tmp_path):
    model, optimizer = make_model()
    checkpointer = AsyncCheckpointer(tmp_path)
    checkpointer.save(5, model, optimizer, {}, None, None)
    assert checkpointer.pending_step in (5, None)
    for _ in range(500):
        if checkpointer.maybe_finalize() is not None or checkpointer.pending_step is None:
            break
        torch.randn(64, 64) @ torch.randn(64, 64)  # "training"
        time.sleep(0.01)
    assert checkpointer.pending_step is None
    assert steps(tmp_path) == [5]


def test_async_failure_is_raised_by_the_next_wait_or_save_and_keeps_previous(tmp_path, monkeypatch):
    model, optimizer = make_model()
    checkpointer = AsyncCheckpointer(tmp_path, keep_last=1)
    checkpointer.save(1, model, optimizer, {}, None, None)
    checkpointer.wait()
    import torch.distributed.checkpoint.filesystem as fs

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(fs, "_write_item", full)
    for step in (2, 3):
        checkpointer.save(step, model, optimizer, {}, None, None)
        with pytest.raises(CheckpointError, match=f"step-000000{step}.*No space left"):
            if step == 2:
                checkpointer.wait()
            else:  # found by maybe_finalize (a warning), raised by the next wait/save
                with pytest.warns(UserWarning, match="asynchronous checkpoint failed"):
                    while checkpointer.pending_step is not None:
                        assert checkpointer.maybe_finalize() is None
                checkpointer.save(4, model, optimizer, {}, None, None)
        assert steps(tmp_path) == [1]
        assert not (tmp_path / f"step-000000{step}.tmp").exists()
    checkpointer.wait()  # the error was raised once, not again


def test_use_async_false_saves_synchronously(tmp_path):
    model, optimizer = make_model()
    checkpointer = AsyncCheckpointer(tmp_path, use_async=False)
    assert checkpointer.save(1, model, optimizer, {}, None, None) == tmp_path / "step-0000001"
    assert steps(tmp_path) == [1]
