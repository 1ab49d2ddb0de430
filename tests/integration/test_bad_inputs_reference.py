"""A preference run's precomputed reference (``RUN/reference/``, train.reference=precomputed)
is checked like a checkpoint before step 1: an edited, cut, missing or forged array, a
manifest that does not describe it, NaN/Inf values and a reference computed from another
starting model are each refused in one line naming the file, with nothing written; a
reference for other data is not reused (a new one is computed); the pass shows progress.

One run trains step 1 of 2 with the reference precomputed (``pref_run``); each row copies
it to ``{tmp}/run``, damages ``reference/`` and resumes it (train.resume=auto).
"""
from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from helpers.bad_inputs import Bad, check_refused, fifo, params, steps, write
from helpers.preference_data import model_dir, pairs, write_pairs
from lmforge.checkpoint.integrity import file_digest
from lmforge.cli import main

RUN_ARGS = ["model.init_from={pref_model}", "data.kind=preference", "data.path={pairs}",
            "data.seq_len=48", "data.micro_batch_size=4", "train.max_steps=2",
            "train.reference=precomputed", "train.device=cpu", "train.log_every=1",
            "train.progress_bar=false"]
RESUME = ["train", *RUN_ARGS, "train.resume=auto", "train.output_dir={tmp}/run"]


@pytest.fixture(scope="session")
def pref_assets(bad_input_assets, tmp_path_factory) -> dict:
    """The shared assets, plus a tiny ChatML model, 24 pairs and a run that stopped after
    step 1 of 2 with its reference precomputed (its stdout as ``pref_run_stdout``)."""
    root = tmp_path_factory.mktemp("pref-reference")
    names = {"pref_model": str(model_dir(root)),
             "pairs": str(write_pairs(root / "pairs.jsonl", pairs(24)))}
    run = root / "run"
    argv = [a.replace("{pref_model}", names["pref_model"]).replace("{pairs}", names["pairs"])
            for a in ["train", *RUN_ARGS, "train.stop_at_step=1", f"train.output_dir={run}"]]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return {**bad_input_assets, **names, "pref_run": run, "pref_run_stdout": out.getvalue()}


# ------------------------------------------------------------------ setups

def copy_run(tmp: Path, assets: dict) -> None:
    shutil.copytree(assets["pref_run"], tmp / "run")


def train_array(tmp: Path) -> Path:
    return next((tmp / "run" / "reference").glob("train-*.npy"))


def manifest_path(tmp: Path) -> Path:
    return tmp / "run" / "reference" / "checksums.json"


def rehash(tmp: Path) -> None:
    """Records the train array's new checksum in the manifest, as a forger would, so that
    only the shape, dtype and value checks stand between it and the loss."""
    path = manifest_path(tmp)
    if not path.is_file():  # (a reference written before manifests: nothing to forge)
        return
    manifest = json.loads(path.read_text())
    name = train_array(tmp).name
    manifest["files"][name].update(file_digest(train_array(tmp)))
    path.write_text(json.dumps(manifest))


def with_run(*setups):
    return steps(copy_run, *setups)


def edit_value(tmp: Path, assets: dict) -> None:
    """The same size, other bytes: one log-probability changed."""
    path = train_array(tmp)
    values = np.load(path)
    values[np.nonzero(values[:, 0])[0][0], 0] += 1.5
    np.save(path, values)


def cut(tmp: Path, assets: dict) -> None:
    path = train_array(tmp)
    path.write_bytes(path.read_bytes()[:-40])


def remove(tmp: Path, assets: dict) -> None:
    train_array(tmp).unlink()


def fewer_rows(tmp: Path, assets: dict) -> None:
    """A valid array of one row less (the last record's log-probabilities gone)."""
    path = train_array(tmp)
    np.save(path, np.load(path)[:-1])
    rehash(tmp)


def as_float32(tmp: Path, assets: dict) -> None:
    path = train_array(tmp)
    np.save(path, np.load(path).astype(np.float32))
    rehash(tmp)


def poison(value: float):
    def setup(tmp: Path, assets: dict) -> None:
        path = train_array(tmp)
        values = np.load(path)
        values[np.nonzero(values[:, 1])[0][0], 1] = value
        np.save(path, values)
        rehash(tmp)
    return setup


def edit_manifest(**changes):
    """Changes keys of the train array's manifest entry (the array stays as it is)."""
    def setup(tmp: Path, assets: dict) -> None:
        manifest = json.loads(manifest_path(tmp).read_text())
        manifest["files"][train_array(tmp).name].update(changes)
        manifest_path(tmp).write_text(json.dumps(manifest))
    return setup


def manifest_entry(name: str):
    def setup(tmp: Path, assets: dict) -> None:
        manifest = json.loads(manifest_path(tmp).read_text())
        manifest["files"][name] = {"sha256": "0" * 64, "bytes": 1}
        manifest_path(tmp).write_text(json.dumps(manifest))
    return setup


def array_as_fifo(tmp: Path, assets: dict) -> None:
    path = train_array(tmp)
    path.unlink()
    fifo(str(path.relative_to(tmp)))(tmp, assets)


def other_model(tmp: Path, assets: dict) -> None:
    """The same weights under another path: a starting model this reference did not come
    from, as far as the run can tell without hashing every weight."""
    shutil.copytree(assets["pref_model"], tmp / "other-model")


# ------------------------------------------------------------------ the table

ARRAY = r"{tmp}/run/reference/train-\w+\.npy"
TO_FIX = r"; delete {tmp}/run/reference to recompute it"

TABLE = [
    Bad("reference array edited", RESUME,
        rf"^{ARRAY}: checksum mismatch \(changed since the reference pass wrote it\){TO_FIX}",
        setup=with_run(edit_value)),
    Bad("reference array cut short", RESUME,
        rf"^{ARRAY}: \d+ bytes, \d+ recorded \(cut short\){TO_FIX}", setup=with_run(cut)),
    Bad("reference array missing", RESUME,
        rf"^{ARRAY}: missing \(recorded in {{tmp}}/run/reference/checksums\.json\){TO_FIX}",
        setup=with_run(remove)),
    Bad("reference array a fifo", RESUME, rf"^{ARRAY}: not a regular file{TO_FIX}",
        setup=with_run(array_as_fifo)),
    Bad("reference array of fewer rows, rehashed", RESUME,
        rf"^{ARRAY}: shape \(\d+, 2\), the manifest records \(\d+, 2\){TO_FIX}",
        setup=with_run(fewer_rows)),
    Bad("reference array float32, rehashed", RESUME,
        rf"^{ARRAY}: dtype float32, the manifest records float64{TO_FIX}",
        setup=with_run(as_float32)),
    Bad("reference array with a nan, rehashed", RESUME,
        rf"^{ARRAY}: 1 NaN/Inf log-probabilities{TO_FIX}", setup=with_run(poison(np.nan))),
    Bad("reference array with an inf, rehashed", RESUME,
        rf"^{ARRAY}: 1 NaN/Inf log-probabilities{TO_FIX}", setup=with_run(poison(-np.inf))),
    Bad("reference manifest rows differ", RESUME,
        rf"^{ARRAY}: shape \(\d+, 2\), the manifest records \(3, 2\){TO_FIX}",
        setup=with_run(edit_manifest(shape=[3, 2]))),
    Bad("reference manifest dtype differs", RESUME,
        rf"^{ARRAY}: dtype float64, the manifest records float16{TO_FIX}",
        setup=with_run(edit_manifest(dtype="float16"))),
    Bad("reference manifest not json", RESUME,
        rf"^{{tmp}}/run/reference/checksums\.json: unreadable \(.*\){TO_FIX}",
        setup=with_run(write("run/reference/checksums.json", "{not json"))),
    Bad("reference manifest a json list", RESUME,
        rf"^{{tmp}}/run/reference/checksums\.json: unreadable \(not a sha256 manifest\)"
        rf"{TO_FIX}", setup=with_run(write("run/reference/checksums.json", "[]"))),
    Bad("reference manifest names a file outside", RESUME,
        rf"^{{tmp}}/run/reference/checksums\.json: unreadable \(bad entry '\.\./x'\){TO_FIX}",
        setup=with_run(manifest_entry("../x"))),
    Bad("reference of another starting model", [*RESUME, "model.init_from={tmp}/other-model"],
        r"^{tmp}/run/reference/checksums\.json: the reference was computed from "
        r"model\.init_from=\S+/model-chatml, this run starts from model\.init_from="
        r"{tmp}/other-model; a run keeps the reference it started with: set "
        r"model\.init_from back, or delete {tmp}/run/reference to recompute it",
        setup=with_run(other_model)),
]


@pytest.mark.parametrize("row", params(TABLE))
def test_reference_input_is_refused_in_one_line(row, pref_assets, tmp_path, capsys,
                                                monkeypatch):
    monkeypatch.delenv("LMFORGE_DEBUG", raising=False)
    check_refused(row, pref_assets, tmp_path, capsys)


# ------------------------------------------------------------------ not refusals

def _resume(tmp_path: Path, assets: dict, *extra: str) -> int:
    names = {"pref_model": assets["pref_model"], "pairs": assets["pairs"],
             "tmp": str(tmp_path)}
    argv = []
    for arg in [*RESUME, *extra]:
        for key, value in names.items():
            arg = arg.replace("{" + key + "}", value)
        argv.append(arg)
    return main(argv)


def test_a_reference_for_other_data_of_the_same_size_is_computed_not_reused(
        pref_assets, tmp_path, capsys):
    """The chosen and rejected answers swapped: as many pairs and tokens as before, so a
    key of counts alone reused the old arrays and trained on the reverse preference."""
    copy_run(tmp_path, pref_assets)
    swapped = [{**r, "chosen": r["rejected"], "rejected": r["chosen"]} for r in pairs(24)]
    data = write_pairs(tmp_path / "swapped.jsonl", swapped)
    old = np.load(train_array(tmp_path))
    assert _resume(tmp_path, pref_assets, f"data.path={data}") == 0
    arrays = sorted((tmp_path / "run" / "reference").glob("train-*.npy"))
    assert len(arrays) == 2, arrays  # the old one kept (its data may come back), a new one
    new = next(np.load(a) for a in arrays if not np.array_equal(np.load(a), old))
    scored = np.nonzero(old[:, 0])[0]
    np.testing.assert_allclose(new[scored], old[scored][:, ::-1], rtol=1e-5, atol=1e-5)
    manifest = json.loads(manifest_path(tmp_path).read_text())
    assert sorted(manifest["files"]) == sorted(
        [a.name for a in (tmp_path / "run" / "reference").glob("*.npy")])


def test_a_reference_written_before_manifests_is_recomputed(pref_assets, tmp_path):
    """No checksums.json (a reference from an earlier lmforge, or a pass killed between
    its array and its manifest): nothing vouches for the arrays, so they are scored again
    from the starting model (the one they came from) and recorded."""
    copy_run(tmp_path, pref_assets)
    before = np.load(train_array(tmp_path))
    manifest_path(tmp_path).unlink()
    np.save(train_array(tmp_path), before + 7.0)  # unrecorded, so not to be trusted
    assert _resume(tmp_path, pref_assets) == 0
    np.testing.assert_allclose(np.load(train_array(tmp_path)), before, rtol=1e-6)
    assert train_array(tmp_path).name in json.loads(manifest_path(tmp_path).read_text())[
        "files"]


def test_a_checkpoint_manifest_that_is_a_json_list_is_refused_in_one_line(
        pref_assets, tmp_path, capsys):
    """The sibling in the checkpoint's own manifest (the same reader): a list was an
    AttributeError traceback."""
    copy_run(tmp_path, pref_assets)
    (tmp_path / "run/checkpoints/step-0000001/checksums.json").write_text("[]")
    assert _resume(tmp_path, pref_assets) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert re.search(r"^lmforge: error: .*step-0000001: unreadable checksums\.json \(not a "
                     r"sha256 manifest\)", err.strip().splitlines()[-1]), err


def test_the_reference_pass_shows_its_progress(pref_assets):
    lines = [line for line in pref_assets["pref_run_stdout"].splitlines()
             if line.startswith("reference:")]
    assert lines, pref_assets["pref_run_stdout"]
    assert "scoring 23 training pairs with the starting model" in lines[0], lines
    assert any("23/23 pairs" in line and "elapsed" in line for line in lines), lines
    assert any("1 held-out pairs" in line for line in lines), lines
    assert lines[-1].startswith("reference: written to "), lines
