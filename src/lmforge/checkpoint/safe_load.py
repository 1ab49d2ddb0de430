"""Reading a checkpoint without running code from it.

DCP stores two things as pickles: ``.metadata`` (read by ``FileSystemReader`` with a
plain ``pickle.load``) and non-tensor entries such as the flattened optimizer
hyperparameters (read by ``DefaultLoadPlanner.load_bytes`` with
``torch.load(weights_only=False)``). Either can name any importable callable, so a
crafted checkpoint could run a shell command at resume or export. Here ``.metadata`` is
read by an unpickler that resolves only the DCP metadata classes and plain data it is
made of, and non-tensor entries by ``torch.load(weights_only=True)``. Tensors were
already read with ``weights_only=True`` by DCP itself.
"""
from __future__ import annotations

import io
import pickle
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from lmforge.checkpoint.collective import CheckpointError, describe
from lmforge.fsio import is_plain_name

METADATA_NAME = ".metadata"

# What a DCP ``.metadata`` pickle is made of (torch 2.11 to 2.13): the metadata
# dataclasses, torch.Size and dtypes, the layout and memory-format decoders
# TensorProperties uses, DCP's per-item file location, and the checkpoint_id path.
_ALLOWED_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
        "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
    "pathlib._local": {"Path", "PosixPath", "WindowsPath", "PurePosixPath",
                       "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _Refused(Exception):
    pass


class MetadataError(CheckpointError):
    """``.metadata`` cannot be used: ``problem`` is "refused", "unreadable" or "missing",
    ``detail`` says why."""

    def __init__(self, path: Path, problem: str, detail: str):
        super().__init__(f"{path}: {problem}: {detail}")
        self.problem, self.detail = problem, detail

    def __reduce__(self):  # sent to other ranks as the plain error it describes
        return CheckpointError, (str(self),)


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the allowlisted names; anything else (os.system, builtins.eval,
    subprocess.Popen...) stops the load before it can be called."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED_CLASSES.get(module, ()):
            return super().find_class(module, name)
        # vars(), not getattr: torch's module __getattr__ imports submodules on demand.
        if module == "torch" and isinstance(vars(torch).get(name), torch.dtype):
            return vars(torch)[name]
        raise _Refused(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused("a persistent id")


def read_metadata_file(path: str | Path) -> dcp_metadata.Metadata:
    """A ``.metadata`` file, unpickled with the allowlist and checked for shape; raises
    ``CheckpointError`` naming the file."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except _Refused as e:
        raise MetadataError(path, "refused", f"the pickle asks for {e}, which a checkpoint "
                                             f"never holds") from None
    except FileNotFoundError:
        raise MetadataError(path, "missing", "no such file") from None
    except Exception as e:  # truncated or garbled bytes
        raise MetadataError(path, "unreadable", describe(e)) from None
    _check_shape(metadata, path)
    return metadata


def _check_shape(metadata: Any, path: Path) -> None:
    """Allowed classes can still be arranged oddly: insist on a Metadata whose files are
    plain names inside the checkpoint directory (no ``../``, no absolute paths)."""
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise MetadataError(path, "unreadable",
                            f"not DCP metadata: holds {type(metadata).__name__}")
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not is_plain_name(name):
            raise MetadataError(path, "refused", f"names a data file outside the "
                                                 f"checkpoint directory ({name!r})")


def data_files(metadata: dcp_metadata.Metadata) -> set[str]:
    """The DCP data files (``__R_I.distcp``) the metadata says hold the entries."""
    return {info.relative_path for info in (metadata.storage_data or {}).values()}


class SafeReader(dcp.FileSystemReader):
    """``FileSystemReader`` whose ``read_metadata`` uses the allowlisting unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        rank = kwargs.get("rank")
        name = METADATA_NAME if rank is None else f"__{rank}{METADATA_NAME}"
        metadata = read_metadata_file(Path(self.path) / name)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # as the base class does
        return metadata


_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that reads non-tensor entries with
    ``torch.load(weights_only=True)``: numbers, strings, tuples and the like load,
    arbitrary objects are refused with the entry and file named."""

    def __init__(self, ckpt_dir: str | Path, **kwargs: Any):
        super().__init__(**kwargs)
        self.ckpt_dir = Path(ckpt_dir)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except Exception as e:
            raise CheckpointError(self._refusal(read_item, e)) from None
        if self.flatten_state_dict:
            _set_path(self.original_state_dict, self.mappings[read_item.dest_index.fqn],
                      loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded

    def _refusal(self, read_item, err: Exception) -> str:
        info = self.metadata.storage_data.get(read_item.storage_index)
        where = self.ckpt_dir / getattr(info, "relative_path", "?")
        fqn = read_item.dest_index.fqn
        asked = _GLOBAL.search(str(err))
        if asked:
            return (f"{where}: refused: entry {fqn} asks for {asked.group(1)}, which a "
                    f"checkpoint never holds")
        return f"{where}: unreadable entry {fqn} ({describe(err).split('. ')[0]})"


def _set_path(root: Any, path: tuple, value: Any) -> None:
    """``root[p0][p1]...[pn] = value`` through containers that already exist (the state
    dict being loaded into was flattened from them); DCP's own helper is private."""
    for key in path[:-1]:
        root = root[key]
    root[path[-1]] = value
