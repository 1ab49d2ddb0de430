"""Where lmforge keeps what it derives from data files: tokenized SFT samples, SFT packing
plans and pretraining sample indexes.

All of it lives under one directory, ``cache_root()``: ``$LMFORGE_CACHE`` when set, else
``$XDG_CACHE_HOME/lmforge``, else ``~/.cache/lmforge``. Nothing is written beside the
data, so a read-only dataset works. An entry is ``<root>/<kind>/<file name>-<hash of its
absolute path>/<key>/``, the key a hash of what the entry was built from: the parameters
that matter (format version, tokenizer, chat template, seq_len, seed, held-out part) and
the data's content fingerprint (``content_fingerprint``: a hash of the bytes, so a copy
with a new modification time hits and an edited file misses). Runs on the same data share
entries; building one for new contents of the same path removes the old ones.

Every file is written under a temporary name and renamed, by every rank that needs it
(the bytes are identical), so ranks need no coordination and the cache works on a
node-local disk as on a shared one. When the cache directory cannot be written, the run's
own cache directory (``RUN_DIR/cache``) is used, else the system temporary directory.

In memory, ``RecentCache`` keeps the few most recently used of those indexes and plans (an
epoch's, a blend block's, a window order) so a stream does not reload them per sample.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Optional

import numpy as np

from lmforge.fsio import atomic_file, atomic_write_bytes, cannot_create_in

CACHE_ENV = "LMFORGE_CACHE"


def cache_root() -> Path:
    """The directory every data cache lives under (see the module doc)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "lmforge"


def cache_dir_for(data_path: str, kind: str, fallback: Optional[Path] = None) -> Path:
    """``<cache_root>/<kind>/<name>-<hash of the absolute path>/``, created; under
    ``fallback`` (or the system temporary directory) when the root is not writable."""
    absolute = os.path.abspath(data_path)
    tag = hashlib.sha1(absolute.encode()).hexdigest()[:16]
    name = Path(kind) / f"{Path(absolute).name}-{tag}"
    for root in (cache_root(), fallback, Path(tempfile.gettempdir()) / "lmforge-cache"):
        if root is None:
            continue
        out = Path(root) / name
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if cannot_create_in(out) is None:
            return out
    raise OSError(f"no writable cache directory for {data_path} (set {CACHE_ENV})")


def content_fingerprint(*paths: str) -> dict:
    """What identifies the files' contents: name -> [size, hash of the bytes]."""
    out = {}
    for p in paths:
        st = os.stat(p)
        out[os.path.basename(p)] = [st.st_size, _digest(os.path.abspath(p), st.st_size,
                                                        st.st_mtime_ns, st.st_ino)]
    return out


@functools.lru_cache(maxsize=64)
def _digest(path: str, size: int, mtime_ns: int, inode: int) -> str:
    """The file's hash, read once per process for a given (size, mtime, inode): a run
    opens the same file for its training and held-out parts."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()[:32]


def keyed_dir(root: Path, params: dict, stamp: dict) -> Path:
    """``root/<hash of params and data stamp>/`` with a meta.json; removes sibling
    directories built for other versions of the same data (the data changed)."""
    key = hashlib.sha1(json.dumps([params, stamp], sort_keys=True).encode()).hexdigest()[:16]
    out = root / key
    meta = out / "meta.json"
    if not meta.is_file():
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(meta, json.dumps({"params": params, "data": stamp}, indent=1).encode())
        for other in root.iterdir():
            if other == out or not other.is_dir():
                continue
            try:
                old = json.loads((other / "meta.json").read_text())
                if old.get("data") != stamp:
                    shutil.rmtree(other, ignore_errors=True)
            except (OSError, ValueError):
                pass
    return out


def save_npy(path: Path, array: np.ndarray) -> None:
    with atomic_file(path) as f:
        np.save(f, array)


def load_or_build(path: Path, build) -> np.ndarray:
    """The cached array at ``path`` (memory-mapped), built and saved on a miss."""
    if path.is_file():
        try:
            return np.load(path, mmap_mode="r")
        except (OSError, ValueError):
            pass  # a damaged cache file is rebuilt
    array = build()
    try:
        save_npy(path, array)
    except OSError:
        pass  # caching is an optimisation; a full disk must not stop training
    return array


class RecentCache:
    """The ``size`` most recently used values by key (an epoch's index or packing plan, a
    blend block), in memory. Pickled empty: a loader worker rebuilds only what it reads."""

    def __init__(self, size: int):
        self.size = size
        self._items: OrderedDict = OrderedDict()

    def get(self, key, build):
        if key in self._items:
            self._items.move_to_end(key)
        else:
            self._items[key] = build()
            while len(self._items) > self.size:
                self._items.popitem(last=False)
        return self._items[key]

    def __getstate__(self) -> dict:
        return {"size": self.size, "_items": OrderedDict()}
