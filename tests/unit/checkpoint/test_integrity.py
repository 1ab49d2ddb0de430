"""Checksums: every save records one per file; resume finds flipped bits, lost shards and
unreadable metadata, falls back (auto) or names the file (explicit path); old
checkpoints without checksums still load; errors say "missing shard" and "disk full"."""
from __future__ import annotations

import errno
import hashlib
import json
import re

import pytest
from helpers.tiny_checkpoints import assert_loads, make_model, save, weights

from lmforge import fsio
from lmforge.checkpoint import (AsyncCheckpointer, CheckpointError, capture_rng,
                                load_checkpoint, read_model_state, resolve_resume)
from lmforge.checkpoint.collective import describe
from lmforge.checkpoint.integrity import MANIFEST_NAME, missing_file, verify_checkpoint


def _two_checkpoints(root):
    model, optimizer = make_model()
    older = save(root, 2, model, optimizer)
    saved = weights(model)
    model2, optimizer2 = make_model(seed=7)
    return older, save(root, 4, model2, optimizer2), saved


def _flip_a_bit(path, offset_fraction=0.5):
    data = bytearray(path.read_bytes())
    data[int(len(data) * offset_fraction)] ^= 0x10
    path.write_bytes(bytes(data))


def test_every_file_of_a_checkpoint_has_its_checksum_recorded(tmp_path):
    model, optimizer = make_model()
    path = save(tmp_path, 3, model, optimizer, keep_last=0)
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    on_disk = {p.name for p in path.iterdir()} - {"COMPLETE", MANIFEST_NAME}
    assert set(manifest["files"]) == on_disk
    assert {".metadata", "__0_0.distcp", "extra.json", "meta.json"} <= on_disk
    for name, recorded in manifest["files"].items():
        data = (path / name).read_bytes()
        assert recorded == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    assert verify_checkpoint(path) is None


def test_an_async_save_records_checksums_too(tmp_path):
    model, optimizer = make_model()
    checkpointer = AsyncCheckpointer(tmp_path)
    checkpointer.save(1, model, optimizer, {"step": 1}, capture_rng(), None)
    path = checkpointer.wait() or tmp_path / "step-0000001"
    assert "rank-00000.pt" in json.loads((path / MANIFEST_NAME).read_text())["files"]
    assert verify_checkpoint(path) is None


def test_flipped_bits_make_auto_fall_back_to_the_previous_checkpoint(tmp_path, capsys):
    older, newest, saved = _two_checkpoints(tmp_path)
    _flip_a_bit(newest / "__0_0.distcp")
    assert resolve_resume("auto", tmp_path) == older
    assert capsys.readouterr().err == (f"train.resume=auto: skipping {newest}: checksum "
                                       f"mismatch in __0_0.distcp\n")  # a plain line
    assert_loads(older, saved)
    with pytest.raises(CheckpointError) as err:
        resolve_resume(str(newest), tmp_path)  # asked for by name: an error, no fallback
    assert str(err.value) == f"train.resume: {newest}: checksum mismatch in __0_0.distcp"
    assert resolve_resume(str(newest), tmp_path, verify=False) == newest
    with pytest.raises(CheckpointError, match="checksum mismatch in __0_0.distcp"):
        read_model_state(newest)  # what export reads: damaged weights are not exported


def test_unreadable_metadata_and_missing_shards_are_skipped_with_the_cause(tmp_path,
                                                                          capsys):
    older, newest, _ = _two_checkpoints(tmp_path)
    (newest / ".metadata").write_bytes(b"\x80\x04garbage")
    assert resolve_resume("auto", tmp_path) == older
    assert re.match(r"train.resume=auto: skipping .*step-0000004: unreadable \.metadata",
                    capsys.readouterr().err)
    (older / "__0_0.distcp").unlink()
    with pytest.raises(CheckpointError, match=r"none of the 2 checkpoints .*verifies "
                       r"\(step-0000004: unreadable \.metadata.*; step-0000002: missing "
                       r"shard __0_0\.distcp \(written by rank 0\)\)"):
        resolve_resume("auto", tmp_path)
    assert capsys.readouterr().err == ""  # the error names them all, in one line
    assert missing_file("__1_0.distcp") == "missing shard __1_0.distcp (written by rank 1)"


def test_a_manifest_naming_files_outside_the_checkpoint_is_refused(tmp_path):
    model, optimizer = make_model()
    path = save(tmp_path, 2, model, optimizer)
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    manifest["files"]["/dev/zero"] = {"sha256": "0", "bytes": 0}
    (path / MANIFEST_NAME).write_text(json.dumps(manifest))
    assert verify_checkpoint(path) == f"unreadable {MANIFEST_NAME} (bad entry '/dev/zero')"


def test_a_missing_shard_is_named_by_load_without_verification(tmp_path):
    model, optimizer = make_model()
    path = save(tmp_path, 2, model, optimizer)
    (path / "__0_0.distcp").unlink()
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path, model, optimizer)
    assert str(err.value) == f"{path}: missing shard __0_0.distcp (written by rank 0)"


def test_checkpoints_without_checksums_still_resume(tmp_path, capsys):
    model, optimizer = make_model()
    path = save(tmp_path, 2, model, optimizer)
    expected = weights(model)
    (path / MANIFEST_NAME).unlink()  # as saved before checksums were recorded
    assert resolve_resume("auto", tmp_path) == path
    assert "no checksums recorded" in capsys.readouterr().err
    assert_loads(path, expected)


def test_a_full_disk_is_reported_as_disk_full(tmp_path, monkeypatch):
    model, optimizer = make_model()

    def no_space(path, data):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(fsio, "write_file", no_space)
    with pytest.raises(CheckpointError, match=r"cannot write checkpoint \(disk full "):
        save(tmp_path, 1, model, optimizer)
    zip_failure = RuntimeError("[enforce fail at inline_container.cc:858] . PytorchStreamWriter"
                               " failed writing file data/0: file write failed")
    assert describe(zip_failure).startswith("disk full, or another failed write (torch: "
                                            "PytorchStreamWriter failed writing file data/0")
