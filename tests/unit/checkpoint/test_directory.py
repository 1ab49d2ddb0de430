"""Atomic commit, discovery, retention and failure handling of checkpoint directories."""
from __future__ import annotations

import errno
import os
import shutil

import pytest
import torch
from helpers.tiny_checkpoints import assert_loads, make_model, save, steps, weights

from lmforge.checkpoint import (MARKER, CheckpointError, clean_stale_tmp, latest_checkpoint,
                                list_checkpoints, load_checkpoint, prune_checkpoints,
                                resolve_resume)
from lmforge.checkpoint import state


# ---------------------------------------------------------------- discovery

def test_incomplete_directories_are_never_listed(tmp_path):
    model, optimizer = make_model()
    save(tmp_path, 2, model, optimizer)
    shutil.copytree(tmp_path / "step-0000002", tmp_path / "step-0000009.tmp")  # has marker
    shutil.copytree(tmp_path / "step-0000002", tmp_path / "step-0000008")
    (tmp_path / "step-0000008" / MARKER).unlink()  # no marker
    (tmp_path / "step-0000007").mkdir()
    (tmp_path / "notes").mkdir()
    assert steps(tmp_path) == [2]
    assert latest_checkpoint(tmp_path) == tmp_path / "step-0000002"
    assert resolve_resume("auto", tmp_path) == tmp_path / "step-0000002"
    for bad in ("step-0000009.tmp", "step-0000008", "step-0000007"):
        with pytest.raises(CheckpointError) as err:
            resolve_resume(str(tmp_path / bad), tmp_path)
        assert bad in str(err.value) and "\n" not in str(err.value)
        with pytest.raises(CheckpointError):
            load_checkpoint(tmp_path / bad, model, optimizer)


def test_resolve_resume_takes_the_newest_or_names_what_is_wrong(tmp_path):
    assert resolve_resume(None, tmp_path) is None
    assert resolve_resume("auto", tmp_path) is None  # nothing yet: a fresh start
    assert resolve_resume("auto", tmp_path / "missing") is None
    with pytest.raises(CheckpointError, match="train.resume: .*nowhere: not found"):
        resolve_resume(str(tmp_path / "nowhere"), tmp_path)
    model, optimizer = make_model()
    save(tmp_path, 1, model, optimizer)
    save(tmp_path, 12, model, optimizer)
    assert resolve_resume("auto", tmp_path) == tmp_path / "step-0000012"
    assert resolve_resume(str(tmp_path / "step-0000001"), tmp_path) == tmp_path / "step-0000001"
    with pytest.raises(CheckpointError, match="newest one inside is .*step-0000012"):
        resolve_resume(str(tmp_path), tmp_path)


def test_checkpoints_are_sorted_by_step_not_by_name(tmp_path):
    model, optimizer = make_model()
    for step in (10, 9, 10_000_000, 100):
        save(tmp_path, step, model, optimizer)
    assert steps(tmp_path) == [9, 10, 100, 10_000_000]


def test_saving_a_step_again_replaces_it(tmp_path):
    model, optimizer = make_model()
    save(tmp_path, 3, model, optimizer)
    with torch.no_grad():
        model.norm.weight.add_(1)
    save(tmp_path, 3, model, optimizer)
    assert steps(tmp_path) == [3]
    assert_loads(tmp_path / "step-0000003", weights(model))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-0000003"]


# ---------------------------------------------------------------- retention

def test_keep_last_prunes_oldest_after_commit(tmp_path):
    model, optimizer = make_model()
    for step in (1, 2, 3, 4):
        save(tmp_path, step, model, optimizer, keep_last=2)
    assert steps(tmp_path) == [3, 4]
    (tmp_path / "step-0000005.tmp").mkdir()  # another save in flight: not touched
    assert prune_checkpoints(tmp_path, 1) == [tmp_path / "step-0000003"]
    assert steps(tmp_path) == [4]
    assert (tmp_path / "step-0000005.tmp").is_dir()
    assert prune_checkpoints(tmp_path, 0) == []  # 0 keeps everything
    assert prune_checkpoints(tmp_path, 1) == []  # never the newest


def test_retention_never_deletes_the_checkpoint_just_committed(tmp_path):
    """A run resumed from step 20 while step 50 exists: its step-30 save is not the
    newest by step number, and must survive keep_last=1 all the same."""
    model, optimizer = make_model()
    for step in (20, 50):
        save(tmp_path, step, model, optimizer)
    assert resolve_resume(str(tmp_path / "step-0000020"), tmp_path) == tmp_path / "step-0000020"
    save(tmp_path, 30, model, optimizer, keep_last=1)
    assert steps(tmp_path) == [30, 50]
    assert prune_checkpoints(tmp_path, 1, protect=tmp_path / "step-0000030") == []


def test_clean_stale_tmp_removes_only_what_crashed_saves_left(tmp_path):
    model, optimizer = make_model()
    save(tmp_path, 1, model, optimizer)
    for name in ("step-0000002.tmp", ".step-0000001.deleting-abcd1234", "keep.tmp"):
        (tmp_path / name).mkdir()
    removed = clean_stale_tmp(tmp_path)
    assert sorted(p.name for p in removed) == [".step-0000001.deleting-abcd1234",
                                               "step-0000002.tmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.tmp", "step-0000001"]


# ----------------------------------------------------------------- failures

def test_unwritable_root_is_one_line_naming_it(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    model, optimizer = make_model()
    root = blocker / "checkpoints"  # mkdir fails under a regular file, even as root
    with pytest.raises(CheckpointError) as err:
        save(root, 1, model, optimizer)
    message = str(err.value)
    assert str(root) in message and "\n" not in message


@pytest.mark.parametrize("fail_in", ["fsync", "write"])
def test_disk_full_keeps_the_previous_checkpoint(tmp_path, monkeypatch, fail_in):
    model, optimizer = make_model()
    save(tmp_path, 1, model, optimizer, keep_last=1)
    good = weights(model)
    with torch.no_grad():
        model.norm.weight.add_(1)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if fail_in == "fsync":  # every file, DCP's and ours, is fsynced before the commit
        monkeypatch.setattr(os, "fsync", full)
    else:  # a failure inside DCP's own writer
        import torch.distributed.checkpoint.filesystem as fs
        monkeypatch.setattr(fs, "_write_item", full)
    with pytest.raises(CheckpointError) as err:
        save(tmp_path, 2, model, optimizer, keep_last=1)
    message = str(err.value)
    assert "step-0000002" in message and "No space left on device" in message
    assert "\n" not in message
    monkeypatch.undo()
    assert steps(tmp_path) == [1]  # not pruned: pruning follows a successful commit only
    assert not (tmp_path / "step-0000002.tmp").exists()
    assert_loads(tmp_path / "step-0000001", good)


def test_crash_mid_write_leaves_no_visible_checkpoint(tmp_path, monkeypatch):
    model, optimizer = make_model()
    save(tmp_path, 1, model, optimizer)

    # The process dies after the DCP files and the marker exist, before the rename: a
    # BaseException that nothing catches, as a kill would leave it.
    def crash(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        save(tmp_path, 2, model, optimizer)
    monkeypatch.undo()
    tmp = tmp_path / "step-0000002.tmp"
    assert (tmp / ".metadata").is_file() and (tmp / MARKER).is_file()
    assert steps(tmp_path) == [1]
    assert resolve_resume("auto", tmp_path) == tmp_path / "step-0000001"
    with pytest.raises(CheckpointError):
        resolve_resume(str(tmp), tmp_path)
    assert clean_stale_tmp(tmp_path) == [tmp]
    save(tmp_path, 2, model, optimizer)  # and the next save works
    assert steps(tmp_path) == [1, 2]


def test_crash_before_the_marker_leaves_no_visible_checkpoint(tmp_path, monkeypatch):
    model, optimizer = make_model()
    real = state.write_side_files

    def side_files_then_die(tmp, *args):
        real(tmp, *args)
        raise SystemExit(1)

    monkeypatch.setattr(state, "write_side_files", side_files_then_die)
    with pytest.raises(SystemExit):
        save(tmp_path, 1, model, optimizer)
    assert (tmp_path / "step-0000001.tmp" / "extra.json").is_file()
    assert list_checkpoints(tmp_path) == [] and latest_checkpoint(tmp_path) is None
