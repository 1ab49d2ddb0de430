"""Checksums of every file a checkpoint holds, written at save time and verified at
resume, so a flipped bit or a lost shard is found before it is trained on.

``checksums.json`` (in the step directory, written before the commit) maps each file
name to its SHA-256 and size. Each rank hashes the files it wrote itself (its DCP shards
``__R_I.distcp`` and its ``rank-RRRRR.pt``) inside DCP's ``write_data``; DCP gathers
every rank's write results to the coordinator anyway, so the digests ride along and rank
0 writes the manifest in ``finish``, after hashing ``.metadata`` and the side files. In
an asynchronous save all of this runs in the background thread: training only pays for
the GIL hand-offs between 8 MiB chunks (hashlib releases the GIL while it hashes).

Verification splits the files into disjoint shares, one per rank, and the ranks agree
on the first problem found.
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Iterable, Optional

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from lmforge import fsio
from lmforge.checkpoint.collective import describe, gather_errors, group_rank, group_size
from lmforge.checkpoint.safe_load import (METADATA_NAME, MetadataError, data_files,
                                          read_metadata_file)

MANIFEST_NAME = "checksums.json"
ALGORITHM = "sha256"
_CHUNK = 8 << 20
# An extra write result that carries a rank's digests to the coordinator; finish()
# takes it out before DCP builds the metadata from the results.
_DIGESTS_FQN = "lmforge.checksums"
_SHARD = re.compile(r"^__(\d+)_\d+\.distcp$")


def file_digest(path: str | Path) -> dict:
    """``{"sha256": hex, "bytes": size}`` of one file, read in chunks."""
    digest = hashlib.new(ALGORITHM)
    size = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return {ALGORITHM: digest.hexdigest(), "bytes": size}


def _digests(directory: Path, names: Iterable[str]) -> dict[str, dict]:
    return {name: file_digest(directory / name) for name in sorted(set(names))}


# --------------------------------------------------------------------------- writing

class HashingWriter(dcp.FileSystemWriter):
    """``FileSystemWriter`` that also records a checksum of every file in the directory
    (see the module docstring). ``own_files``: names this rank wrote beside DCP."""

    def __init__(self, path: str | Path, own_files: Iterable[str] = (), **kwargs: Any):
        super().__init__(str(path), **kwargs)
        self.own_files = list(own_files)

    def write_data(self, plan, planner):
        return super().write_data(plan, planner).then(self._with_digests)

    def _with_digests(self, future) -> list[WriteResult]:
        results = future.value()
        directory = Path(self.path)
        names = {r.storage_data.relative_path for r in results}
        names.update(n for n in self.own_files if (directory / n).is_file())
        carrier = WriteResult(index=MetadataIndex(_DIGESTS_FQN), size_in_bytes=0,
                              storage_data=_digests(directory, names))
        return [*results, carrier]

    def finish(self, metadata, results) -> None:
        digests: dict[str, dict] = {}
        plain = []
        for rank_results in results:
            plain.append([r for r in rank_results if r.index.fqn != _DIGESTS_FQN])
            for r in rank_results:
                if r.index.fqn == _DIGESTS_FQN:
                    digests.update(r.storage_data)
        super().finish(metadata, plain)
        directory = Path(self.path)
        rest = [p.name for p in directory.iterdir()
                if p.is_file() and p.name not in digests and p.name != MANIFEST_NAME]
        digests.update(_digests(directory, rest))  # .metadata and rank 0's side files
        manifest = {"algorithm": ALGORITHM, "files": dict(sorted(digests.items()))}
        fsio.write_file(directory / MANIFEST_NAME,
                        (json.dumps(manifest, indent=1) + "\n").encode())


# ------------------------------------------------------------------------- verifying

def read_manifest(path: Path) -> Optional[dict[str, dict]]:
    """``{name: {"sha256", "bytes"}}``, or None for a checkpoint saved before checksums
    were recorded. Raises ``ValueError``/``OSError`` when the manifest is unreadable."""
    manifest_path = path / MANIFEST_NAME
    if not manifest_path.is_file():
        return None
    manifest = json.loads(manifest_path.read_text())
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or manifest.get("algorithm") != ALGORITHM:  # (a list)
        raise ValueError(f"not a {ALGORITHM} manifest")
    for name, recorded in files.items():
        # Only names inside the directory: a crafted manifest must not make verification
        # read /dev/zero or a file elsewhere.
        if not fsio.is_plain_name(name) or not isinstance(recorded, dict):
            raise ValueError(f"bad entry {name!r}")
    return files


def missing_file(name: str) -> str:
    shard = _SHARD.match(name)
    if shard:
        return f"missing shard {name} (written by rank {shard.group(1)})"
    return f"missing file {name}"


def missing_shard(path: Path, metadata) -> Optional[str]:
    """The first data file the metadata refers to that is not on disk."""
    for name in sorted(data_files(metadata)):
        if not (path / name).is_file():
            return missing_file(name)
    return None


def _check_file(path: Path, name: str, recorded: Optional[dict]) -> Optional[str]:
    if not (path / name).is_file():
        return missing_file(name)
    if recorded is None:
        return f"no checksum recorded for {name}"
    try:
        found = file_digest(path / name)
    except OSError as e:
        return f"unreadable {name} ({describe(e)})"
    if found != {ALGORITHM: recorded.get(ALGORITHM), "bytes": recorded.get("bytes")}:
        return f"checksum mismatch in {name}"
    return None


def check_share(path: Path, part: int = 0, parts: int = 1) -> Optional[str]:
    """The first problem in this rank's share of ``path``'s files, None when they are
    fine. Every share reads the metadata and the manifest; files are hashed once."""
    try:
        metadata = read_metadata_file(path / METADATA_NAME)
    except MetadataError as e:
        return f"{e.problem} {METADATA_NAME} ({e.detail})"
    try:
        manifest = read_manifest(path)
    except (OSError, ValueError) as e:
        return f"unreadable {MANIFEST_NAME} ({describe(e)})"
    if manifest is None:
        return missing_shard(path, metadata)
    names = sorted(set(manifest) | data_files(metadata))
    for name in names[part::parts]:
        problem = _check_file(path, name, manifest.get(name))
        if problem:
            return problem
    return None


def verify_checkpoint(path: str | Path, process_group=None) -> Optional[str]:
    """Collective when distributed: every rank checks a disjoint share of the files and
    all return the same answer, the first problem found (None: it verifies). A
    checkpoint without checksums is only checked for missing shards."""
    path = Path(path)
    parts = group_size(process_group)
    return next(iter(gather_errors(check_share(path, group_rank(process_group), parts),
                                   process_group)), None)


def has_checksums(path: str | Path) -> bool:
    return (Path(path) / MANIFEST_NAME).is_file()

