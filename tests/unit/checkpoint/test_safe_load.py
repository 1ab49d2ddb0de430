"""Loading a checkpoint never runs code from it: a pickle payload planted in ``.metadata``
or in an optimizer entry is refused with one line naming the file, and never executes."""
from __future__ import annotations

import os
import pickle

import pytest
import torch
from helpers.tiny_checkpoints import assert_loads, make_model, save, weights

from lmforge.checkpoint import (CheckpointError, load_checkpoint, read_model_state,
                                resolve_resume)


class _Touch:
    """Unpickling this creates ``marker`` (what an attacker's shell command would do)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)

    def __deepcopy__(self, memo):  # get_state_dict copies param groups: not a trigger
        return self


def _saved(tmp_path):
    model, optimizer = make_model()
    return save(tmp_path / "ckpts", 3, model, optimizer), model


def _assert_refused(call, marker, names: str):
    with pytest.raises(CheckpointError) as err:
        call()
    message = str(err.value)
    assert "\n" not in message and names in message and "refused" in message, message
    assert not marker.exists(), "the payload ran"
    return message


def test_a_payload_in_dcp_metadata_is_refused_and_never_runs(tmp_path):
    path, _ = _saved(tmp_path)
    marker = tmp_path / "pwned"
    (path / ".metadata").write_bytes(pickle.dumps(_Touch(marker)))
    model, optimizer = make_model(seed=1)
    message = _assert_refused(lambda: load_checkpoint(path, model, optimizer), marker,
                              f"{path / '.metadata'}: refused")
    assert "system" in message  # what the pickle asked for is named
    _assert_refused(lambda: read_model_state(path, verify=False), marker,
                    f"{path / '.metadata'}: refused")
    _assert_refused(lambda: read_model_state(path), marker, f"{path}: refused .metadata")
    message = _assert_refused(lambda: resolve_resume(str(path), path.parent), marker,
                              f"train.resume: {path}: refused .metadata")
    assert "system" in message


def test_a_payload_in_an_optimizer_entry_is_refused_and_never_runs(tmp_path):
    model, optimizer = make_model()
    marker = tmp_path / "pwned"
    optimizer.param_groups[0]["lr"] = _Touch(marker)  # stored with torch.save (a pickle)
    path = save(tmp_path / "ckpts", 3, model, optimizer)
    assert not marker.exists()
    model2, optimizer2 = make_model(seed=1)
    message = _assert_refused(lambda: load_checkpoint(path, model2, optimizer2), marker,
                              str(path / "__0_0.distcp"))
    assert "optimizer.param_groups." in message and ".lr" in message


def test_checkpoints_written_by_the_plain_dcp_writer_still_load(tmp_path, monkeypatch):
    """Checkpoints from before the safe reader (same DCP format, no checksums) load."""
    import torch.distributed.checkpoint as dcp
    from lmforge.checkpoint import state

    model, optimizer = make_model()
    expected = weights(model)
    monkeypatch.setattr(state, "dcp_writer",
                        lambda tmp: dcp.FileSystemWriter(str(tmp), sync_files=True))
    path = save(tmp_path, 2, model, optimizer)
    monkeypatch.undo()
    assert not (path / "checksums.json").exists()
    assert resolve_resume("auto", tmp_path) == path
    assert_loads(path, expected)
    sd = read_model_state(path)
    assert all(torch.equal(sd[k], v) for k, v in expected.items())


def test_a_payload_in_a_rank_file_is_refused_without_advising_weights_only_false(tmp_path):
    path, _ = _saved(tmp_path)
    marker = tmp_path / "pwned"
    torch.save({"rng": _Touch(marker)}, path / "rank-00000.pt")
    model, optimizer = make_model(seed=1)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path, model, optimizer)
    message = str(err.value)
    assert message.startswith(f"{path / 'rank-00000.pt'}: not readable (refused: the pickle "
                              f"asks for posix.system"), message
    assert "weights_only" not in message and "\n" not in message, message
    assert not marker.exists(), "the payload ran"
