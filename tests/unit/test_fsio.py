"""Atomic writes: a reader, or a crash, sees the old content or the new, never half of it,
and nothing temporary is left behind."""
from __future__ import annotations

import errno
import os
import socket
import stat
import subprocess

import pytest

from lmforge import fsio


def names(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_atomic_dir_replaces_an_existing_directory_as_a_whole(tmp_path):
    out = tmp_path / "model"
    with fsio.atomic_dir(out) as tmp:
        (tmp / "a.txt").write_text("old")
        (tmp / "old-only.txt").write_text("old")
    with fsio.atomic_dir(out) as tmp:
        assert names(out) == ["a.txt", "old-only.txt"]  # untouched while the new one is built
        (tmp / "a.txt").write_text("new")
    assert names(out) == ["a.txt"] and (out / "a.txt").read_text() == "new"
    assert names(tmp_path) == ["model"]


def test_atomic_dir_failure_keeps_the_old_directory_and_removes_the_temporary_one(tmp_path):
    out = tmp_path / "nested" / "model"
    with fsio.atomic_dir(out) as tmp:
        (tmp / "a.txt").write_text("old")
    with pytest.raises(KeyboardInterrupt):  # BaseException too: a kill mid-write
        with fsio.atomic_dir(out) as tmp:
            (tmp / "a.txt").write_text("half")
            raise KeyboardInterrupt
    assert (out / "a.txt").read_text() == "old"
    assert names(out.parent) == ["model"]


def test_atomic_file_appears_complete_or_not_at_all(tmp_path):
    path = tmp_path / "meta.json"
    fsio.atomic_write_bytes(path, b"first")
    with pytest.raises(OSError):
        with fsio.atomic_file(path) as f:
            f.write(b"second, cut short")
            raise OSError("disk full")
    assert path.read_bytes() == b"first"
    assert names(tmp_path) == ["meta.json"]


def test_written_files_are_fsynced(tmp_path, monkeypatch):
    synced = []
    real = os.fsync

    def spy(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    with fsio.atomic_dir(tmp_path / "out") as tmp:
        (tmp / "weights.bin").write_bytes(b"1234")
    assert any(p.endswith("weights.bin") for p in synced)
    assert str(tmp_path) in synced  # the rename itself is made durable


def test_set_aside_leftovers_are_recognised_by_their_original_name(tmp_path):
    directory = tmp_path / "step-0000003"
    directory.mkdir()
    aside = fsio.set_aside(directory, "deleting")
    assert fsio.set_aside_original(aside.name) == "step-0000003"
    assert fsio.set_aside_original("step-0000003") is None
    assert fsio.set_aside_original(".step-0000003.tmp") is None
    fsio.remove_dir(aside)
    assert names(tmp_path) == []


as_root = pytest.mark.skipif(os.geteuid() == 0, reason="root ignores file permissions")


def test_check_writable_accepts_new_and_existing_destinations(tmp_path):
    fsio.check_writable(tmp_path / "new" / "deeper" / "out.json", "--output")
    fsio.check_writable(tmp_path / "new-dir", "OUT_DIR", kind="dir")
    (tmp_path / "old.json").write_text("{}")
    fsio.check_writable(tmp_path / "old.json", "--output")
    fsio.check_writable(tmp_path, "OUT_DIR", kind="dir")


def test_check_writable_refuses_the_wrong_kind_of_thing_in_the_way(tmp_path):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(NotADirectoryError, match=r"a-file/out.json: cannot write --output: "
                                                 r".*a-file is a file, not a directory"):
        fsio.check_writable(tmp_path / "a-file" / "out.json", "--output")
    with pytest.raises(NotADirectoryError, match=r"a-file: OUT_DIR is a directory to write, "
                                                 r"but a file is in the way"):
        fsio.check_writable(tmp_path / "a-file", "OUT_DIR", kind="dir")
    with pytest.raises(IsADirectoryError, match=r"--output is a file to write, but a "
                                                r"directory is in the way"):
        fsio.check_writable(tmp_path, "--output")


@as_root
def test_check_writable_refuses_a_read_only_directory_naming_it(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "old.json").write_text("{}")
    locked.chmod(0o500)
    try:
        with pytest.raises(PermissionError, match=r"no permission to create files in "
                                                  r".*locked$"):
            fsio.check_writable(locked / "sub" / "out.json", "--output")
        with pytest.raises(PermissionError, match="locked"):
            fsio.check_writable(locked, "OUT_DIR", kind="dir")
    finally:
        locked.chmod(0o700)


def test_a_lock_whose_file_its_holder_removes_meanwhile_is_taken_on_the_new_file(
        tmp_path, monkeypatch):
    """B opens the lock file, A releases it (deleting the file), B's flock succeeds on the
    deleted file: B must lock the file now under the name, or C would take that one too."""
    path = tmp_path / "x.lock"
    a = fsio.FileLock(path, remove=True)
    a.acquire()
    flock, calls = fsio.locks._flock, []

    def a_releases_first(fd):
        if not calls:
            a.release()
        calls.append(fd)
        return flock(fd)

    monkeypatch.setattr(fsio.locks, "_flock", a_releases_first)
    b = fsio.FileLock(path, remove=True)
    b.acquire()
    assert len(calls) == 2, "B locked the deleted file and kept it"
    with pytest.raises(fsio.LockHeld) as held:
        fsio.FileLock(path, remove=True).acquire()
    assert held.value.holder["pid"] == os.getpid()
    b.release()
    assert not path.exists()


# ------------------------------------------------------------- reading what others wrote

def test_outside_dir_accepts_plain_names_and_links_that_stay_inside(tmp_path):
    (tmp_path / "shard.safetensors").write_bytes(b"x")
    (tmp_path / "alias.safetensors").symlink_to("shard.safetensors")
    assert fsio.outside_dir(tmp_path, "shard.safetensors") is None
    assert fsio.outside_dir(tmp_path, "alias.safetensors") is None
    assert fsio.outside_dir(tmp_path, "not-yet-written.safetensors") is None


@pytest.mark.parametrize("name", ["../../../etc/passwd", "/etc/passwd", "sub/shard", "..",
                                  ".", "", None, 3])
def test_outside_dir_refuses_anything_but_a_plain_name(tmp_path, name):
    assert fsio.outside_dir(tmp_path, name) == "not a plain file name inside the directory"


def test_outside_dir_refuses_a_link_leaving_the_directory(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (tmp_path / "secret").write_text("key")
    (model / "shard.safetensors").symlink_to(tmp_path / "secret")
    problem = fsio.outside_dir(model, "shard.safetensors")
    assert problem == f"a link to {tmp_path.resolve() / 'secret'}, outside the directory"


def test_outside_dir_accepts_a_hub_cache_snapshot_linking_into_its_blobs(tmp_path):
    """transformers' cache: snapshots/<revision>/ holds links to ../../blobs/<hash>; the
    link to a sibling repository's blobs is still refused."""
    repo = tmp_path / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "abc123").write_bytes(b"x")
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (snapshot / "model.safetensors").symlink_to("../../blobs/abc123")
    assert fsio.outside_dir(snapshot, "model.safetensors") is None
    other = tmp_path / "models--org--other" / "blobs"
    other.mkdir(parents=True)
    (other / "def456").write_bytes(b"x")
    (snapshot / "stolen.safetensors").symlink_to(other / "def456")
    assert "outside the directory" in fsio.outside_dir(snapshot, "stolen.safetensors")


def _weights_only_error(payload, protocol: int) -> Exception:
    import io
    import pickle

    import torch
    buffer = io.BytesIO(pickle.dumps(payload, protocol=protocol))
    try:
        torch.load(buffer, weights_only=True)
    except Exception as e:  # noqa: BLE001 - the error torch raises is what is tested
        return e
    raise AssertionError("torch.load accepted the payload")


class _System:
    def __reduce__(self):
        return os.system, ("true",)


def test_torch_load_error_names_what_the_pickle_asked_for_without_torchs_advice():
    error = _weights_only_error(_System(), protocol=2)
    assert "weights_only` set to `False`" in str(error)  # torch's advice, to be dropped
    message = fsio.torch_load_error(error)
    assert message == ("refused: the pickle asks for posix.system, which a weights-only "
                       "load never runs")
    assert "weights_only" not in message and "\n" not in message


def test_torch_load_error_of_an_unreadable_pickle_keeps_the_reason_only():
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns about the pickle protocol
        error = _weights_only_error({"a": 1}, protocol=4)  # an opcode it does not read
    message = fsio.torch_load_error(error)
    assert message.startswith("refused: a pickle a weights-only load cannot read")
    assert "weights_only" not in message and "trusted source" not in message, message
    assert fsio.torch_load_error(OSError("disk gone")) == "disk gone"


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="no /proc on this system")
def test_check_writable_refuses_a_directory_that_takes_no_new_files_whatever_its_mode():
    # /proc's mode lets root write (os.access says yes), but it takes no new file.
    with pytest.raises(PermissionError, match=r"^/proc/out.json: cannot write --output: "
                                              r"/proc (does not accept new files|.*permission)"):
        fsio.check_writable("/proc/out.json", "--output")
    with pytest.raises(PermissionError, match=r"^/proc/a/b: cannot write OUT_DIR"):
        fsio.check_writable("/proc/a/b", "OUT_DIR", kind="dir")


@pytest.mark.parametrize("code, why", [
    (errno.EROFS, "the file system is read-only"), (errno.ENOSPC, "no space left"),
    (errno.ENOENT, "creating a file there failed: No such file or directory")])
def test_check_writable_tries_a_file_and_says_in_plain_words_why_it_failed(
        tmp_path, monkeypatch, code, why):
    (tmp_path / "out-dir").mkdir()
    fsio.check_writable(tmp_path / "out-dir", "OUT_DIR", kind="dir")
    fsio.check_writable(tmp_path / "new" / "out.json", "--output")
    assert names(tmp_path) == ["out-dir"] and names(tmp_path / "out-dir") == []  # tried, gone
    real_open = os.open

    def refusing_open(path, flags, *args):
        if ".lmforge-probe" in str(path):
            raise OSError(code, os.strerror(code), str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refusing_open)
    with pytest.raises(PermissionError, match=rf"out.json: cannot write --output: {tmp_path} "
                                              rf"does not accept new files \({why}"):
        fsio.check_writable(tmp_path / "out.json", "--output")


# ------------------------------------------- what a writer must never replace or open

def special_files(directory) -> dict:
    """A FIFO, a character device (the null device's numbers) and a socket's file in
    ``directory``, by the name a message gives their kind."""
    os.mkfifo(directory / "fifo")
    os.mknod(directory / "device", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    here = os.getcwd()
    os.chdir(directory)  # bound by a relative name: tmp_path may exceed a socket address
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.bind("socket")
    finally:
        os.chdir(here)
    return {"a FIFO": directory / "fifo", "a character device": directory / "device",
            "a socket": directory / "socket"}


@pytest.mark.skipif(os.geteuid() != 0, reason="creating a device node needs root")
def test_check_writable_refuses_a_device_fifo_or_socket_in_the_way_without_opening_it(
        tmp_path):
    for what, path in special_files(tmp_path).items():  # a FIFO opened here would block
        with pytest.raises(fsio.NotWritable, match=rf"^{path}: --output is a file to write, "
                                                   rf"but {what} is in the way"):
            fsio.check_writable(path, "--output")
        with pytest.raises(fsio.NotWritable, match=rf"^{path}: OUT_DIR is a directory to "
                                                   rf"write, but {what} is in the way"):
            fsio.check_writable(path, "OUT_DIR", kind="dir")
        link = tmp_path / f"link-to-{path.name}"  # an in-place writer writes through it
        link.symlink_to(path)
        with pytest.raises(fsio.NotWritable, match=rf"but {what} is in the way"):
            fsio.check_writable(link, "--output")
    assert stat.S_ISFIFO(os.lstat(tmp_path / "fifo").st_mode)


@pytest.mark.skipif(os.geteuid() != 0, reason="creating a device node needs root")
def test_check_writable_refuses_an_output_directory_holding_one_anywhere_below(tmp_path):
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    (out / "config.json").write_text("{}")
    fsio.check_writable(out, "OUT_DIR", kind="dir")  # regular files and directories: fine
    (tmp_path / "made").mkdir()
    for what, made in special_files(tmp_path / "made").items():  # one at a time
        path = made.rename(out / "sub" / made.name)
        with pytest.raises(fsio.NotWritable, match=rf"^{out}: cannot write OUT_DIR: {path} "
                                                   rf"in it is {what}"):
            fsio.check_writable(out, "OUT_DIR", kind="dir")
        path.unlink()
    (out / "tokenizer.json").symlink_to(tmp_path / "nowhere")  # dangling: nothing to open
    fsio.check_writable(out, "OUT_DIR", kind="dir")


def test_check_apart_refuses_an_output_that_is_inside_or_holds_an_input(tmp_path):
    model, data = tmp_path / "model", tmp_path / "data.jsonl"
    model.mkdir()
    data.write_text("{}\n")
    inputs = [("--model", model), ("--data", data), ("--adapter", None)]
    fsio.check_apart(tmp_path / "out", "--output", inputs)  # beside them: fine
    fsio.check_apart(tmp_path / "model-2", "--output", inputs)  # a prefix is not a parent
    refused = {data: "is the input --data", model / "m.gguf": "lies inside the input --model",
               tmp_path: "holds the input --model"}
    (tmp_path / "link").symlink_to(model)
    os.link(data, tmp_path / "hard.jsonl")
    refused.update({tmp_path / "link" / "x": "lies inside the input --model",
                    tmp_path / "hard.jsonl": "is the input --data"})
    for output, how in refused.items():
        with pytest.raises(fsio.NotWritable, match=rf"^{output}: --output {how}"):
            fsio.check_apart(output, "--output", inputs)


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_stale_temporaries_of_this_hosts_dead_processes_are_removed_and_no_others(tmp_path):
    host, dead = socket.gethostname(), _dead_pid()
    stale = [tmp_path / f".out.tmp-{host}-{dead}-0123abcd",  # tmp_sibling's, a directory
             tmp_path / f"out.tmp-{host}-{dead}"]  # tmp_tag's (the indexed writer's)
    stale[0].mkdir()
    (stale[0] / "weights").write_bytes(b"\0" * 64)
    stale[1].write_bytes(b"\0" * 64)
    kept = [f".out.tmp-{host}-{os.getpid()}-0123abcd",  # alive
            f".out.tmp-{host}x-{dead}-0123abcd",  # another host whose name starts alike
            f".out.tmp-other-{dead}-0123abcd", f"out.tmp-other-{dead}",  # another host
            f".outer.tmp-{host}-{dead}-0123abcd",  # another target
            f".out.old-0123abcd", "out"]  # not a temporary
    for name in kept:
        (tmp_path / name).write_bytes(b"")
    assert sorted(fsio.remove_stale_temporaries(tmp_path / "out")) == sorted(stale)
    assert names(tmp_path) == sorted(kept)
    assert fsio.remove_stale_temporaries(tmp_path / "missing" / "out") == []


def test_an_atomic_write_removes_its_targets_stale_temporaries(tmp_path):
    stale = tmp_path / f".meta.json.tmp-{socket.gethostname()}-{_dead_pid()}-0123abcd"
    stale.write_bytes(b"half")
    fsio.atomic_write_bytes(tmp_path / "meta.json", b"{}")
    with fsio.atomic_dir(tmp_path / "model") as tmp:
        assert tmp.name.startswith(f".model.tmp-{socket.gethostname()}-{os.getpid()}-")
    assert names(tmp_path) == ["meta.json", "model"]


def test_a_lock_file_is_never_written_through_a_link_or_into_a_fifo(tmp_path):
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me")
    (tmp_path / "run.lock").symlink_to(precious)
    os.mkfifo(tmp_path / "fifo.lock")
    for name, why in (("run.lock", "a symbolic link"), ("fifo.lock", "not a regular file")):
        with pytest.raises(OSError, match=why):
            fsio.FileLock(tmp_path / name, remove=True).acquire()
    assert precious.read_text() == "keep me"
    assert (tmp_path / "run.lock").is_symlink()
    assert stat.S_ISFIFO(os.lstat(tmp_path / "fifo.lock").st_mode)


def test_a_growing_file_left_before_its_first_piece_leaves_the_old_file(tmp_path):
    (tmp_path / "out.jsonl").write_text("old\n")
    with pytest.raises(KeyboardInterrupt):
        with fsio.growing_file(tmp_path / "out.jsonl"):
            raise KeyboardInterrupt
    assert (tmp_path / "out.jsonl").read_text() == "old\n"
    assert names(tmp_path) == ["out.jsonl"]


def test_a_growing_file_holds_every_piece_appended_before_it_was_left(tmp_path):
    (tmp_path / "out.jsonl").write_text("old\n")
    with pytest.raises(KeyboardInterrupt):
        with fsio.growing_file(tmp_path / "out.jsonl") as out:
            out.append(b"1\n")
            assert (tmp_path / "out.jsonl").read_text() == "1\n"  # in place at once
            out.append(b"2\n")
            assert (tmp_path / "out.jsonl").read_text() == "1\n2\n"
            raise KeyboardInterrupt
    assert (tmp_path / "out.jsonl").read_text() == "1\n2\n"
    assert names(tmp_path) == ["out.jsonl"]
