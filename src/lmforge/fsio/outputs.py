"""Where a writer may write: ``check_writable`` (the kind of thing in the way, the
permissions, a directory that takes no new files) and ``check_apart`` (an output that is,
lies inside or holds one of the command's own inputs), both before any work."""
from __future__ import annotations

import errno
import os
import stat
import uuid
from pathlib import Path
from typing import Optional


def check_writable(path: str | Path, what: str, kind: str = "file") -> None:
    """Refuse, before any work, an output ``path`` (a ``kind`` "file" or "dir") that could
    not be written, or whose writing would destroy something: the wrong kind of thing in
    the way (a directory, or a device, FIFO or socket, which a writer would replace, write
    into, or block on), no permission, or a directory that takes no new files. An
    existing output directory is replaced as a whole by some writers and filled in place
    by others, so nothing in it may be a device, FIFO or socket either. Every writer here
    creates or renames entries in the parent, so the nearest existing ancestor must be a
    writable directory; a file is created there and removed to prove it (permission bits
    do not tell: root passes them, and /proc, /sys or a read-only mount refuse files
    whatever they say). ``what`` names the option in the message. Nothing is opened: a
    FIFO is never waited on."""
    path = Path(path)
    if kind not in ("file", "dir"):
        raise ValueError(f"kind must be file or dir, got {kind!r}")
    found = _kind_of(path)
    if kind == "file" and found == "a directory":
        raise IsADirectoryError(f"{path}: {what} is a file to write, but a directory is "
                                f"in the way")
    if found not in (None, "a directory", "a regular file"):
        raise NotWritable(f"{path}: {what} is a {'file' if kind == 'file' else 'directory'} "
                          f"to write, but {found} is in the way (lmforge writes over "
                          f"regular files only)")
    if kind == "dir" and found == "a regular file":
        raise NotADirectoryError(f"{path}: {what} is a directory to write, but a file is "
                                 f"in the way")
    if found and not os.access(path, os.W_OK | (os.X_OK if kind == "dir" else 0)):
        raise PermissionError(f"{path}: {what} is not writable (permission denied)")
    if found == "a directory":
        _check_entries(path, what)
    parent = _nearest_existing(path.parent)
    if not parent.is_dir():
        raise NotADirectoryError(f"{path}: cannot write {what}: {parent} is a file, not a "
                                 f"directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"{path}: cannot write {what}: no permission to create "
                              f"files in {parent}")
    # An existing output directory is filled in place by some writers, so it is tried too.
    for directory in (parent, *([path] if kind == "dir" and path.is_dir() else [])):
        problem = cannot_create_in(directory)
        if problem:
            raise PermissionError(f"{path}: cannot write {what}: {directory} does not "
                                  f"accept new files ({problem})")


class NotWritable(ValueError):
    """An output that lmforge refuses to write: something other than a regular file or a
    directory is in its way, or it is one of the command's own inputs."""


# st_mode kind -> its name in a message
_KINDS = {stat.S_IFREG: "a regular file", stat.S_IFDIR: "a directory",
          stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket"}
MAX_ENTRIES_CHECKED = 10_000  # an output directory holds a model, not a file system


def _kind_of(path: Path) -> Optional[str]:
    """What ``path`` is, links followed (a writer in place writes through them), or None
    when nothing (or a dangling link) is there."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    return _KINDS.get(stat.S_IFMT(mode), "a special file")


def _check_entries(directory: Path, what: str) -> None:
    """Refuse an existing output directory holding a device, FIFO or socket (itself or
    behind a link) anywhere below: a writer in place would write into it or block on it,
    one that replaces the directory would delete it. The first ``MAX_ENTRIES_CHECKED``
    entries are looked at."""
    seen = 0
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            seen += 1
            if seen > MAX_ENTRIES_CHECKED:
                return
            found = _kind_of(Path(root, name))
            if found not in (None, "a directory", "a regular file"):
                raise NotWritable(f"{directory}: cannot write {what}: "
                                  f"{Path(root, name)} in it is {found} (lmforge writes "
                                  f"over regular files only)")


def check_apart(output: str | Path, what: str, inputs, within: bool = True) -> None:
    """Refuse an output that is one of the command's own inputs, lies inside one (an
    input directory the command reads as a whole), or holds one (a directory a writer
    replaces): writing it would destroy what the command reads, or change the input for
    the next run. ``inputs``: (option, path) pairs; None paths are skipped. Links are
    resolved before comparing, and a hard link to an input file is that file.
    ``within=False``: an output may lie inside an input directory (a writer whose files
    are never read as that input, as a dataset's .bin/.idx beside its .jsonl), unless
    the output is a link that leads there."""
    out = Path(output).resolve()
    for option, given in inputs:
        if given is None:
            continue
        src = Path(given).resolve()
        if out == src or _same_file(out, src):
            how = "is"
        elif out.is_relative_to(src) and (within or Path(output).is_symlink()):
            how = "lies inside"
        elif src.is_relative_to(out):
            how = "holds"
        else:
            continue
        raise NotWritable(f"{output}: {what} {how} the input {option} {given}; write it "
                          f"elsewhere (a command never writes over what it reads)")


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


# errno -> why, in plain words, a directory refused a new file
_REFUSALS = {errno.EROFS: "the file system is read-only",
             errno.EACCES: "permission denied", errno.EPERM: "permission denied",
             errno.ENOSPC: "no space left on the device",
             errno.EDQUOT: "the disk quota is used up"}


def cannot_create_in(directory: Path) -> Optional[str]:
    """Why a file cannot be created in ``directory`` (None: it can): one is created and
    removed at once."""
    probe = directory / f".lmforge-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except OSError as e:
        return _REFUSALS.get(e.errno, f"creating a file there failed: {e.strerror or e}")
    os.unlink(probe)
    return None


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path
