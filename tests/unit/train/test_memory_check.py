"""A run whose memory estimate exceeds its device's memory is refused in one line before
anything is allocated or written (no lock, no config.yaml), naming the estimate, the
budget and what to change; train.skip_memory_check=true lets it start; the dry run says
the same. The budget is patched, so the tests do not depend on this machine's memory."""
import re

import pytest

from lmforge.cli import main
from lmforge.config import ConfigError, load_config
from lmforge.job import resolve
from lmforge.perf import budget as B
from lmforge.perf.estimate import GiB
from lmforge.train import loop

DEMO = ["train.device=cpu", "train.max_steps=2"]  # the demo's estimate: about 0.5 GiB


class Started(Exception):
    """Raised where the run's set-up begins: the memory check is behind it."""


@pytest.fixture
def budget(monkeypatch):
    def set_to(gib: float):
        monkeypatch.setattr(B, "device_budget",
                            lambda device: B.Budget(gib * GiB, "the test's budget"))
    return set_to


def test_a_run_over_its_budget_is_refused_in_one_line_before_anything_is_written(
        budget, tmp_path, monkeypatch, capsys):
    budget(0.1)
    monkeypatch.chdir(tmp_path)
    assert main(["train", *DEMO, f"train.output_dir={tmp_path}/run"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("lmforge: error: memory: "), err
    assert re.search(r"needs about 0\.\d GiB per device \(lmforge estimate\) but the test's "
                     r"budget is 0\.1 GiB; try .*train\.skip_memory_check=true", err), err
    assert list(tmp_path.iterdir()) == [], "no run directory, lock or config.yaml"


def test_skip_memory_check_lets_a_run_over_its_budget_start(budget, monkeypatch):
    budget(0.1)

    def started(*args, **kwargs):
        raise Started

    monkeypatch.setattr(loop, "init_runtime", started)
    with pytest.raises(ConfigError, match="^memory: "):
        loop.train(load_config(None, DEMO))
    with pytest.raises(Started):
        loop.train(load_config(None, [*DEMO, "train.skip_memory_check=true"]))


def test_dry_run_says_whether_the_run_fits_and_exits_2_when_it_does_not(
        budget, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    budget(0.1)
    assert main(["train", "--dry-run", *DEMO]) == 2
    out, err = capsys.readouterr()
    assert "does NOT fit in 0.1 GiB (the test's budget)" in out
    assert "config is valid" not in out
    assert err.strip().startswith("lmforge: error: memory: ") and "\n" not in err.strip()
    budget(64)
    assert main(["train", "--dry-run", *DEMO]) == 0
    out = capsys.readouterr().out
    assert "fits in 64.0 GiB (the test's budget)" in out and "config is valid" in out
    assert list(tmp_path.iterdir()) == []


def test_the_demo_fits_this_machine_as_it_is():
    check = B.check_memory(resolve(load_config(None, DEMO)))
    assert check.budget is not None and check.fits
    assert check.estimate_bytes < 1 * GiB
