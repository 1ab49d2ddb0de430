"""A run directory has one owner: the lock, the fresh-run rule, train.overwrite."""
import json
import os
import socket
import subprocess
import sys

import pytest

from lmforge.config import ConfigError, JobConfig
from lmforge.fsio import holder_alive
from lmforge.train.run_dir import LOCK_NAME, RunLock, claim_run_dir


def _checkpoint(run_dir, step):
    path = run_dir / "checkpoints" / f"step-{step:07d}"
    path.mkdir(parents=True)
    (path / "COMPLETE").write_text("{}")
    (path / "__0_0.distcp").write_bytes(b"weights")
    return path


def _cfg(**train):
    cfg = JobConfig()
    for key, value in train.items():
        setattr(cfg.train, key, value)
    return cfg


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_second_holder_is_refused_naming_the_first(tmp_path):
    first = RunLock(tmp_path)
    first.acquire()
    with pytest.raises(ConfigError) as refused:
        RunLock(tmp_path).acquire()  # a second open file: flock refuses it, same process too
    message = str(refused.value)
    assert message.startswith("train.output_dir:") and "\n" not in message
    assert LOCK_NAME in message and f"pid {os.getpid()}" in message
    first.release()
    second = RunLock(tmp_path)
    second.acquire()  # released: free again
    second.release()


def test_a_lock_left_by_a_killed_run_is_taken_over(tmp_path):
    (tmp_path / LOCK_NAME).write_text(json.dumps(
        {"pid": _dead_pid(), "host": socket.gethostname(), "started": "earlier"}))
    lock = RunLock(tmp_path)
    lock.acquire()  # nobody holds the flock: the dead run's record does not matter
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] != "earlier"
    lock.release()
    assert "released" in json.loads((tmp_path / LOCK_NAME).read_text())


def test_without_flock_the_recorded_holder_decides(monkeypatch):
    here = socket.gethostname()
    assert holder_alive({"pid": os.getpid(), "host": here})
    assert not holder_alive({"pid": _dead_pid(), "host": here})
    assert holder_alive({"pid": 1, "host": here + "-elsewhere"})  # cannot see it: trust it
    assert not holder_alive({"pid": os.getpid(), "host": here, "released": "then"})
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    # a requeued SLURM job finds its own earlier attempt's lock: that attempt is over
    assert not holder_alive({"pid": 1, "host": here + "-elsewhere", "slurm_job": "77"})


def test_fresh_run_in_a_directory_with_checkpoints_is_refused_and_touches_nothing(tmp_path):
    step = _checkpoint(tmp_path, 20)
    (tmp_path / "metrics.jsonl").write_text('{"step": 20, "loss": 1.0}\n')
    with pytest.raises(ConfigError) as refused:
        claim_run_dir(_cfg(), tmp_path)
    assert "step-0000020" in str(refused.value)
    assert "train.resume=auto" in str(refused.value)
    assert "train.overwrite=true" in str(refused.value)
    assert (step / "__0_0.distcp").read_bytes() == b"weights"
    assert (tmp_path / "metrics.jsonl").read_text().startswith('{"step": 20')
    RunLock(tmp_path).acquire()  # the refused run let its lock go


def test_resume_auto_continues_and_overwrite_starts_over(tmp_path):
    step = _checkpoint(tmp_path, 20)
    claim_run_dir(_cfg(resume="auto"), tmp_path).release()
    assert step.is_dir()
    (tmp_path / "hf").mkdir()
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "cache").mkdir()
    claim = claim_run_dir(_cfg(overwrite=True), tmp_path)
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "hf").exists()
    assert not (tmp_path / "metrics.jsonl").exists()
    claim.start(_cfg(overwrite=True))  # the earlier outputs, set aside until now, go
    claim.release()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "config.yaml", LOCK_NAME]
    assert (tmp_path / "cache").is_dir()  # keyed by its sources: still valid


def test_a_run_refused_before_it_starts_leaves_its_directory_as_it_was(tmp_path):
    """An earlier run's outputs (set aside by train.overwrite), its lock file, and what
    set-up wrote: the undo puts everything back byte for byte."""
    step = _checkpoint(tmp_path, 20)
    (tmp_path / "metrics.jsonl").write_text('{"step": 20}\n')
    (tmp_path / LOCK_NAME).write_text('{"released": "earlier"}\n')
    (tmp_path / "notes.txt").write_text("mine\n")
    before = _tree(tmp_path)
    claim = claim_run_dir(_cfg(overwrite=True), tmp_path)
    (tmp_path / "tokenizer").mkdir()  # what set-up writes before a refusal
    (tmp_path / "tokenizer" / "tokenizer.json").write_text("{}")
    (tmp_path / "metrics.jsonl").write_text("")
    claim.undo()
    assert _tree(tmp_path) == before
    assert (step / "__0_0.distcp").read_bytes() == b"weights"


def test_a_refused_run_removes_the_directory_it_created(tmp_path):
    run_dir = tmp_path / "a" / "b" / "run"
    claim = claim_run_dir(_cfg(), run_dir)
    (run_dir / "cache").mkdir()
    claim.undo()
    assert list(tmp_path.iterdir()) == []


def test_the_lock_file_a_refused_run_created_is_removed_and_a_found_one_restored(tmp_path):
    claim = claim_run_dir(_cfg(), tmp_path / "run")
    (tmp_path / "run" / "kept.txt").write_text("x")  # the directory is no longer empty
    claim.created = None  # as if the directory had been there
    claim.undo()
    assert not (tmp_path / "run" / LOCK_NAME).exists()
    (tmp_path / "run" / LOCK_NAME).write_bytes(b"not json at all")
    claim_run_dir(_cfg(), tmp_path / "run").undo()
    assert (tmp_path / "run" / LOCK_NAME).read_bytes() == b"not json at all"


def _tree(root) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None
            for p in sorted(root.rglob("*"))}


def test_overwrite_with_resume_is_refused():
    with pytest.raises(ConfigError, match="train.overwrite"):
        _cfg(overwrite=True, resume="auto").validate()


@pytest.fixture
def train_without_set_up(monkeypatch):
    """``train`` whose runtime set-up fails the test: what it refuses, it refuses first."""
    from lmforge.train import loop

    def no_set_up(*args, **kwargs):
        raise AssertionError("the runtime was set up before train.resume was checked")

    monkeypatch.setattr(loop, "init_runtime", no_set_up)
    return loop.train


def test_a_missing_resume_path_is_refused_before_any_set_up(tmp_path, train_without_set_up):
    cfg = _cfg(resume=str(tmp_path / "run" / "checkpoints" / "step-0000010"),
               output_dir=str(tmp_path / "run"))
    with pytest.raises(ConfigError, match=r"^train.resume: .*step-0000010: not found"):
        train_without_set_up(cfg)


def test_resuming_an_older_checkpoint_beside_later_ones_is_refused(tmp_path,
                                                                    train_without_set_up):
    """A rewind to step 20 beside step 50 would leave step 50 for the next resume=auto."""
    older, _ = _checkpoint(tmp_path, 20), _checkpoint(tmp_path, 50)
    cfg = _cfg(resume=str(older), output_dir=str(tmp_path))
    with pytest.raises(ConfigError, match=r"step-0000020 is older than step-0000050"):
        train_without_set_up(cfg)
    assert (tmp_path / "checkpoints" / "step-0000050" / "__0_0.distcp").is_file()


def _train_own_tokenizer(tmp_path, run_dir, monkeypatch, refuse: bool):
    """A run that trains its tokenizer on the corpus into a run directory holding an
    earlier run's tokenizer/; ``refuse``: refused right after the tokenizer."""
    from helpers.tiny_models import tiny_model_overrides
    from lmforge.config import load_config
    from lmforge.train import loop

    (tmp_path / "corpus.txt").write_text("\n".join(f"alpha beta {i} gamma delta tensor"
                                                   for i in range(200)))
    cfg = load_config(None, [*tiny_model_overrides(n_layers=1, vocab_size=300), "data.kind=text",
                             f"data.path={tmp_path / 'corpus.txt'}",
                             "data.tokenizer_vocab_size=280", "data.eval_fraction=0",
                             "data.seq_len=16", "data.micro_batch_size=2",
                             "train.max_steps=1", "train.sample_prompt=null",
                             "train.device=cpu", f"train.output_dir={run_dir}"])
    if refuse:
        def refused(*args, **kwargs):
            raise ConfigError("data.path: refused (test)")
        monkeypatch.setattr(loop, "build_data", refused)
    return loop.train(cfg)


def test_a_refused_run_puts_back_the_tokenizer_it_would_have_retrained(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    (run_dir / "tokenizer").mkdir(parents=True)
    (run_dir / "tokenizer" / "tokenizer.json").write_text('{"an earlier run": 1}')
    before = _tree(run_dir)
    with pytest.raises(ConfigError, match="refused"):
        _train_own_tokenizer(tmp_path, run_dir, monkeypatch, refuse=True)
    assert _tree(run_dir) == before


def test_a_run_that_starts_replaces_the_earlier_tokenizer_and_keeps_no_copy(tmp_path,
                                                                            monkeypatch):
    run_dir = tmp_path / "run"
    (run_dir / "tokenizer").mkdir(parents=True)
    (run_dir / "tokenizer" / "tokenizer.json").write_text('{"an earlier run": 1}')
    _train_own_tokenizer(tmp_path, run_dir, monkeypatch, refuse=False)
    assert (run_dir / "tokenizer" / "tokenizer.json").read_text() != '{"an earlier run": 1}'
    assert not [p for p in run_dir.iterdir() if p.name.startswith(".tokenizer.")]
