"""The data cache directory: where it is, that nothing is written beside the data, and that
entries are keyed by the data's content and shared between runs."""
from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np
import pytest

from lmforge.data import sft as sft_mod
from lmforge.data.cache import cache_root
from lmforge.data.preprocess import preprocess
from lmforge.data.pretrain import PretrainDataset
from lmforge.data.sft import SFTDataset

from .conftest import make_docs, write_jsonl


def _chat(path: Path, n: int = 12, seed: int = 0) -> Path:
    docs = make_docs(2 * n, seed=seed, min_words=1, max_words=6)
    return write_jsonl(path, [{"prompt": docs[2 * i], "response": docs[2 * i + 1]}
                              for i in range(n)])


def _listing(root: Path) -> dict:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*")}


def test_cache_root_is_lmforge_cache_else_xdg_cache_home_else_home(monkeypatch, tmp_path):
    monkeypatch.setenv("LMFORGE_CACHE", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "mine"
    monkeypatch.delenv("LMFORGE_CACHE")
    assert cache_root() == tmp_path / "xdg" / "lmforge"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "lmforge"


def test_a_read_only_data_dir_gets_nothing_written_beside_it(tmp_path, tokenizer,
                                                           tokenizer_dir, data_cache):
    data = tmp_path / "data"
    data.mkdir()
    chat = _chat(data / "chat.jsonl")
    src = write_jsonl(tmp_path / "docs.jsonl", [{"text": d} for d in make_docs(40, seed=1)])
    preprocess([src], data / "corpus", tokenizer_dir, append_eod=True)
    before = _listing(data)
    data.chmod(stat.S_IRUSR | stat.S_IXUSR)  # read-only (root ignores it: the listing tells)
    try:
        packed = SFTDataset(chat, tokenizer, "plain", 64, pack=True)
        plain = SFTDataset(chat, tokenizer, "plain", 64)
        pretrain = PretrainDataset(data / "corpus", 16, seed=1)
        assert packed.rows_in_epoch(0) and len(plain[0]["input_ids"]) == 64
        assert len(pretrain[0]["input_ids"]) == 16
    finally:
        data.chmod(stat.S_IRWXU)
    assert _listing(data) == before
    for ds in (packed, plain, pretrain):
        assert ds.cache.is_relative_to(data_cache)
    assert list(packed.cache.glob("pack-*.npy"))  # the packing plan is cached too


def test_the_sft_cache_is_shared_between_runs_and_keyed_by_the_content(tmp_path, tokenizer,
                                                                       monkeypatch):
    path = _chat(tmp_path / "chat.jsonl")
    first = SFTDataset(path, tokenizer, "plain", 64)
    stamp = path.stat().st_mtime_ns + 10**9
    os.utime(path, ns=(stamp, stamp))  # a fresh copy of the same bytes
    with monkeypatch.context() as m:
        m.setattr(sft_mod, "tokenize_file", lambda *a, **k: pytest.fail("tokenized again"))
        again = SFTDataset(path, tokenizer, "plain", 64, seed=3)  # another run's seed
    assert again.cache == first.cache
    np.testing.assert_array_equal(again.sample(0)[0], first.sample(0)[0])
    _chat(path, seed=1)  # new contents at the same path: a new entry, the old one removed
    changed = SFTDataset(path, tokenizer, "plain", 64)
    assert changed.cache != first.cache and not first.cache.exists()
    assert changed.cache.parent == first.cache.parent
