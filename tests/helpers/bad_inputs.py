"""The harness of the bad-input tables (tests/integration/test_bad_inputs*.py): a row is
a command line that must be refused in one line: exit status 2, ``lmforge: error: `` and a
message naming the field, the option or the file (and line) at fault, no traceback, and
nothing written or replaced: the row's directory, where every output of the command line
points, holds afterwards exactly what it held before, byte for byte, each entry still the
same kind of file (a FIFO stays a FIFO, a device a device, a link the same link).

A row is a name, the command line, the message it must print (a regular expression
searched after "lmforge: error: "), and what to build first. Command lines and paths may
name ``{tmp}`` (the row's own empty directory) and the assets built once for the session
(tests/integration/conftest.py): ``{model}`` (a tiny transformers Llama with its
tokenizer), ``{adapter}`` (a PEFT adapter for it), ``{tokenizer}`` (the tokenizer alone),
``{text}`` (a small text corpus) and ``{chat}`` (prompt/response JSONL).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import pytest

from lmforge import fsio
from lmforge.cli import main
from lmforge.config import LoraConfig
from lmforge.data.indexed import IndexedDatasetWriter
from lmforge.data.tokenizer import train_bpe
from lmforge.models.hf import load_hf_model, save_hf_model
from lmforge.peft import apply_lora, save_adapter

from helpers.tiny_models import tiny_llama


@dataclass(frozen=True)
class Bad:
    name: str
    argv: list[str]
    message: str  # a regular expression the one line must match after "lmforge: error: "
    setup: Optional[Callable[[Path, dict], None]] = None  # (row dir, assets) -> files
    marks: tuple = field(default=())


# ----------------------------------------------------------------- assets built once

def build_assets(root: Path) -> dict:
    """The assets every bad-input table shares, built once per session under ``root``."""
    lines = [f"line {i} of a small corpus about tensors and shards" for i in range(200)]
    (root / "corpus.txt").write_text("\n".join(lines) + "\n")
    records = [{"prompt": f"Say hello {i}", "response": f"Hello {i}."} for i in range(40)]
    (root / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    tok = train_bpe(lines + [json.dumps(r) for r in records], 300)
    tok.save(root / "tokenizer")
    save_hf_model(tiny_llama(vocab_size=tok.vocab_size), root / "model", tokenizer=tok)
    model = load_hf_model(root / "model")
    apply_lora(model, LoraConfig(enabled=True, rank=4, alpha=8.0,
                                 targets=["q_proj", "v_proj"]))
    save_adapter(model, root / "adapter", base_model_path=str(root / "model"))
    return {"model": root / "model", "adapter": root / "adapter",
            "tokenizer": root / "tokenizer", "text": root / "corpus.txt",
            "chat": root / "chat.jsonl"}


def copy_asset(name: str, to: str = None):
    """A setup that copies asset ``name`` into the row's directory (as ``to``), for rows
    that damage it; the row's argv then names ``{tmp}/<to>``."""
    def setup(tmp: Path, assets: dict) -> None:
        src = assets[name]
        dst = tmp / (to or name)
        (shutil.copytree if src.is_dir() else shutil.copy)(src, dst)
    return setup


def edit_json(path: str, **changes):
    """A setup step that changes keys of a JSON file under the row's directory."""
    def setup(tmp: Path, assets: dict) -> None:
        file = tmp / path
        data = json.loads(file.read_text())
        data.update(changes)
        file.write_text(json.dumps(data))
    return setup


def write(path: str, content: str | bytes):
    def setup(tmp: Path, assets: dict) -> None:
        file = tmp / path
        file.parent.mkdir(parents=True, exist_ok=True)
        (file.write_bytes if isinstance(content, bytes) else file.write_text)(content)
    return setup


_HELD = []  # locks held for a row by "another job": this process, on its own open file


def hold_lock(path: str):
    """A setup that holds ``fsio.FileLock`` on a path under the row's directory until the
    test process ends, as a job still running would."""
    def setup(tmp: Path, assets: dict) -> None:
        lock = fsio.FileLock(tmp / path, remove=True)
        lock.acquire()
        _HELD.append(lock)
    return setup


def same_shape_pairs(tmp: Path, assets: dict) -> None:
    """Two indexed pairs a and b of equal sequence lengths, a's .bin replaced by b's (as
    two preprocess jobs racing on one prefix could leave it): the index checks pass."""
    for name, first in (("a", 1), ("b", 100)):
        with IndexedDatasetWriter(tmp / name, np.uint16) as w:
            w.add_document(np.arange(first, first + 40))
    (tmp / "b.bin").replace(tmp / "a.bin")


def edit_tensors(path: str, change):
    """A setup step that rewrites a safetensors file under the row's directory:
    ``change(tensors)`` edits the dict of tensors in place."""
    def setup(tmp: Path, assets: dict) -> None:
        from safetensors.torch import load_file, save_file
        tensors = load_file(tmp / path)
        change(tensors)
        save_file(tensors, str(tmp / path))
    return setup


def poison(name_part: str, value: float):
    """``change`` for ``edit_tensors``: the first tensor whose name holds ``name_part``
    gets ``value`` in one element."""
    def change(tensors: dict) -> None:
        name = next(k for k in sorted(tensors) if name_part in k)
        tensors[name].view(-1)[0] = value
    return change


def shard_index(target: str, link: Optional[str] = None):
    """A setup step that turns the row's model copy into a sharded one whose index names
    ``target`` (``link``: make ``target`` a symlink to that asset's file first)."""
    def setup(tmp: Path, assets: dict) -> None:
        model = tmp / "model"
        (model / "model.safetensors").unlink()
        if link is not None:
            (model / target).symlink_to(assets[link] / "model.safetensors")
        (model / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {"model.embed_tokens.weight": target}}))
    return setup


def fake_checkpoint(config_yaml: str):
    """A setup: ``{tmp}/run/checkpoints/step-0000001``, committed (its marker), holding
    only a config.yaml of the given text."""
    def setup(tmp: Path, assets: dict) -> None:
        step = tmp / "run" / "checkpoints" / "step-0000001"
        step.mkdir(parents=True)
        (step / "COMPLETE").write_text('{"step": 1}\n')
        (step / "config.yaml").write_text(config_yaml)
    return setup


def steps(*setups):
    def setup(tmp: Path, assets: dict) -> None:
        for s in setups:
            s(tmp, assets)
    return setup


# Command lines and setups the model-directory, adapter and generate rows share.
GEN = ["generate", "--model", "{tmp}/model", "--prompt", "hi"]  # on the row's model copy
MERGE = ["lora", "merge", "--model", "{model}", "--adapter", "{tmp}/adapter", "--output",
         "{tmp}/out"]


def model_with(*setups):
    return steps(copy_asset("model"), *setups)


def adapter_with(*setups):
    return steps(copy_asset("adapter"), *setups)


def adapter_config(**changes):
    return adapter_with(edit_json("adapter/adapter_config.json", **changes))


def fifo(path: str):
    """A setup: a FIFO at ``path`` under the row's directory (a writer that opened it would
    block until a reader came, or replace it)."""
    def setup(tmp: Path, assets: dict) -> None:
        file = tmp / path
        file.parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(file)
    return setup


def params(table: list) -> list:
    """The table's rows as pytest parameters, named by the row."""
    names = [row.name for row in table]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    assert not duplicates, f"row names must be unique: {duplicates}"
    return [pytest.param(r, id=r.name, marks=r.marks) for r in table]


def check_refused(row: Bad, assets: dict, tmp_path: Path, capsys) -> str:
    """Runs ``row`` and asserts the one-line refusal and the untouched directory; returns
    the line, for a caller that checks more of it."""
    if row.setup:
        row.setup(tmp_path, assets)
    names = {**{k: str(v) for k, v in assets.items()}, "tmp": str(tmp_path)}
    before = snapshot(tmp_path)
    code = main([fill(arg, names) for arg in row.argv])
    err = capsys.readouterr().err.strip()
    assert code == 2, f"exit {code}; stderr: {err[:2000]!r}"
    assert "\n" not in err and "Traceback" not in err, err[:2000]
    assert err.startswith("lmforge: error: "), err[:2000]
    assert re.search(fill(row.message, {k: re.escape(v) for k, v in names.items()}),
                     err[len("lmforge: error: "):]), err[:2000]
    after = snapshot(tmp_path)
    changed = sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))
    assert not changed, "changed: " + ", ".join(changed)
    return err


def snapshot(root: Path) -> dict:
    """Each entry under ``root`` (not following links) -> its kind and content: a regular
    file's SHA-256, a link's target, a device's number; FIFOs and sockets are never
    opened."""
    entries = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            info = path.lstat()
            kind = stat.S_IFMT(info.st_mode)
            if stat.S_ISREG(info.st_mode):
                content = hashlib.sha256(path.read_bytes()).hexdigest()
            elif stat.S_ISLNK(info.st_mode):
                content = os.readlink(path)
            elif stat.S_ISCHR(info.st_mode) or stat.S_ISBLK(info.st_mode):
                content = info.st_rdev
            else:
                content = None
            entries[str(path.relative_to(root))] = (kind, content)
    return entries


def fill(text: str, names: dict) -> str:
    """``{name}`` replaced by its value (not str.format: a regex has braces of its own)."""
    for key, value in names.items():
        text = text.replace("{" + key + "}", value)
    return text
