"""A table of bad inputs across every command. Each row is refused in one line: exit
status 2, ``lmforge: error: `` and a message naming the field, the option or the file (and
line) at fault, no traceback, and nothing written: the row's directory, where every
output of the command line points, holds afterwards exactly what it held before.

The next hole found goes here as a row: a name, the command line, the message it must
print (a regular expression searched after "lmforge: error: "), and what to build first.
Command lines and paths may name ``{tmp}`` (the row's own empty directory) and the assets
built once for the whole table: ``{model}`` (a tiny transformers Llama with its
tokenizer), ``{adapter}`` (a PEFT adapter for it), ``{tokenizer}`` (the tokenizer alone),
``{text}`` (a small text corpus) and ``{chat}`` (prompt/response JSONL).
"""
from __future__ import annotations

import json
import re
import shutil
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

@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("assets")
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


def steps(*setups):
    def setup(tmp: Path, assets: dict) -> None:
        for s in setups:
            s(tmp, assets)
    return setup


# ----------------------------------------------------------------- the table
# Sections by command; keep a row's name unique (it is the test id).

HUGE_CPU_RUN = ["model.preset=llama3-70b", "model.vocab_size=128256", "data.seq_len=4096",
                "train.device=cpu"]
OVER_MEMORY = (r"^memory: the run needs about \d+\.\d GiB per device .* GiB; try .*"
               r"train\.skip_memory_check=true")

TRAIN = [
    Bad("negative lr", ["train", "optim.lr=-1", "train.output_dir={tmp}/run"],
        r"optim\.lr"),
    Bad("infinite lr", ["train", "optim.lr=inf", "train.output_dir={tmp}/run"],
        r"optim\.lr"),
    Bad("unknown key", ["train", "optim.nope=1", "train.output_dir={tmp}/run"],
        r"optim\.nope"),
    Bad("unknown preset", ["train", "model.preset=gpt5", "train.output_dir={tmp}/run"],
        r"model\.preset"),
    Bad("missing config file", ["train", "{tmp}/nope.yaml"], r"nope\.yaml: not found"),
    Bad("missing init_from", ["train", "model.init_from={tmp}/absent",
                              "train.output_dir={tmp}/run"],
        r"model\.init_from"),
    # A full 70B training step on the CPU: about 2.6 TiB per process, over any CI machine.
    Bad("model over the machine's memory", ["train", *HUGE_CPU_RUN,
                                            "train.output_dir={tmp}/run"], OVER_MEMORY),
    Bad("dry run of a model over the machine's memory",
        ["train", "--dry-run", *HUGE_CPU_RUN, "train.output_dir={tmp}/run"], OVER_MEMORY),
]

MODEL_DIRS = [
    Bad("broken config.json", ["generate", "--model", "{tmp}/model", "--prompt", "hi"],
        r"config\.json", setup=steps(copy_asset("model"), write("model/config.json", "{x"))),
]

ADAPTERS = [
]

NOT_UTF8 = bytes(range(128, 256)) * 160  # 20 KB of bytes no UTF-8 decoder accepts

DATA = [
    Bad("text corpus of random bytes",
        ["train", "data.kind=text", "data.path={tmp}/noise.bin", "train.output_dir={tmp}/run"],
        r"^data\.path: {tmp}/noise\.bin:1: not valid UTF-8 \(byte 0x80 at byte offset 0",
        setup=write("noise.bin", NOT_UTF8)),
    Bad("text corpus with a broken JSON line",
        ["train", "data.kind=text", "data.path={tmp}/c.jsonl", "train.output_dir={tmp}/run"],
        r"^data\.path: {tmp}/c\.jsonl:2: not valid JSON",
        setup=write("c.jsonl", '{"text": "fine"}\n{"text": "cut\n')),
    Bad("text corpus of empty records",
        ["train", "data.kind=text", "data.path={tmp}/c.jsonl", "train.output_dir={tmp}/run"],
        r"^data\.path: {tmp}/c\.jsonl: no text to train on",
        setup=write("c.jsonl", '{"text": ""}\n{"text": ""}\n')),
    Bad("text eval_path without text",
        ["train", "data.kind=text", "data.path={text}", "data.eval_path={tmp}/held.txt",
         "train.output_dir={tmp}/run"],
        r"^data\.eval_path: {tmp}/held\.txt: no text to train on",
        setup=write("held.txt", "\n\n")),
    Bad("SFT file of empty answers only",
        ["train", "model.init_from={model}", "data.kind=sft", "data.path={tmp}/chat.jsonl",
         "train.output_dir={tmp}/run"],
        r"^data\.path: {tmp}/chat\.jsonl: every record's assistant answer is empty",
        setup=write("chat.jsonl", '{"prompt": "hi", "response": ""}\n' * 3)),
    Bad("preprocess of an empty file",
        ["preprocess", "--input", "{tmp}/empty.jsonl", "--output-prefix", "{tmp}/p",
         "--tokenizer", "{tokenizer}"],
        r"^--input {tmp}/empty\.jsonl: no documents to write",
        setup=write("empty.jsonl", "")),
    Bad("tokenizer train on an empty file",
        ["tokenizer", "train", "--input", "{tmp}/empty.txt", "--vocab-size", "300",
         "--output", "{tmp}/tok"],
        r"^--input {tmp}/empty\.txt: no text to train a tokenizer on",
        setup=write("empty.txt", "")),
    Bad("preprocess to a prefix another job writes",
        ["preprocess", "--input", "{text}", "--output-prefix", "{tmp}/p",
         "--tokenizer", "{tokenizer}"],
        r"^--output-prefix: {tmp}/p is being written by another preprocess \(pid \d+",
        setup=hold_lock("p.lock")),
    Bad("pretraining on a .bin and .idx from two writes",
        ["train", "data.kind=pretrain", "data.path={tmp}/a", "model.tokenizer={tokenizer}",
         "train.output_dir={tmp}/run"],
        r"^{tmp}/a\.bin and {tmp}/a\.idx are not one pair", setup=same_shape_pairs),
    Bad("negative pad_to_multiple_of", ["train", "data.pad_to_multiple_of=-8",
                                        "train.output_dir={tmp}/run"],
        r"data\.pad_to_multiple_of: must be >= 0"),
    Bad("SFT grouped by length and packed",
        ["train", "model.init_from={model}", "data.kind=sft", "data.path={chat}",
         "data.pack=true", "data.group_by_length=true", "train.output_dir={tmp}/run"],
        r"^data\.group_by_length: cannot be combined with data\.pack=true \(packing already "
        r"removes the padding\)"),
]

GENERATE = [
]

LAUNCH = [
]

EXPORT_AND_EVAL = [
    Bad("eval of a missing model", ["eval", "--model", "{tmp}/absent", "--data", "{text}"],
        r"absent"),
]

TABLE = TRAIN + MODEL_DIRS + ADAPTERS + DATA + GENERATE + LAUNCH + EXPORT_AND_EVAL


def test_row_names_are_unique():
    names = [row.name for row in TABLE]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("row", [pytest.param(r, id=r.name, marks=r.marks) for r in TABLE])
def test_bad_input_is_refused_in_one_line(row: Bad, assets, tmp_path, capsys,
                                          monkeypatch):
    monkeypatch.delenv("LMFORGE_DEBUG", raising=False)
    if row.setup:
        row.setup(tmp_path, assets)
    names = {**{k: str(v) for k, v in assets.items()}, "tmp": str(tmp_path)}
    before = set(tmp_path.rglob("*"))
    code = main([_fill(arg, names) for arg in row.argv])
    err = capsys.readouterr().err.strip()
    assert code == 2, f"exit {code}; stderr: {err!r}"
    assert "\n" not in err and "Traceback" not in err, err
    assert err.startswith("lmforge: error: "), err
    assert re.search(_fill(row.message, {k: re.escape(v) for k, v in names.items()}),
                     err[len("lmforge: error: "):]), err
    assert set(tmp_path.rglob("*")) == before, "wrote " + ", ".join(
        str(p.relative_to(tmp_path)) for p in set(tmp_path.rglob("*")) - before)


def _fill(text: str, names: dict) -> str:
    """``{name}`` replaced by its value (not str.format: a regex has braces of its own)."""
    for key, value in names.items():
        text = text.replace("{" + key + "}", value)
    return text
