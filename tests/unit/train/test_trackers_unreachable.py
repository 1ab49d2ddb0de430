"""A tracker whose server cannot be reached fails within seconds in one line (MLflow's
defaults retried a closed port for about 4 minutes before step 1, printing nothing): the
run goes on without it, or, with metrics.tracker_required, is refused before its
directory is made. Servers here are 127.0.0.1 ports only: one nothing listens on, and
one the test holds open that accepts connections and never answers."""
from __future__ import annotations

import socket
import time

import pytest

from helpers.runs import free_port, tiny_corpus, tiny_overrides  # noqa: F401
from lmforge.cli import main
from lmforge.config import ConfigError, MetricsConfig
from lmforge.train.trackers import check_trackers, start_trackers, unreachable

SECONDS = 15  # "within seconds": the probe's 5 s, MLflow's 10 s start timeout, and slack


@pytest.fixture
def no_accounts(monkeypatch):
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL", "MLFLOW_TRACKING_URI",
                 "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")


@pytest.fixture
def silent_server():
    """A port that accepts connections (the kernel's backlog) and never answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


def mlflow_at(uri: str, required: bool = False) -> MetricsConfig:
    return MetricsConfig(tracker="mlflow", mlflow_tracking_uri=uri, tracker_required=required)


def test_a_closed_port_is_unreachable_and_a_listening_one_or_a_local_store_is_not(
        no_accounts, silent_server, tmp_path):
    start = time.monotonic()
    reason = unreachable("mlflow", mlflow_at(f"http://127.0.0.1:{free_port()}"))
    assert time.monotonic() - start < SECONDS
    assert "cannot be reached" in reason and "127.0.0.1" in reason
    assert unreachable("mlflow", mlflow_at(silent_server)) is None
    assert unreachable("mlflow", mlflow_at(f"sqlite:///{tmp_path}/m.db")) is None
    assert unreachable("mlflow", mlflow_at(None)) is None  # the SQLite file beside the run
    assert unreachable("tensorboard", mlflow_at(None)) is None
    offline = MetricsConfig(tracker="wandb", wandb_mode="offline")
    assert unreachable("wandb", offline) is None


@pytest.mark.slow
@pytest.mark.long  # (make test-long: a whole run, about 10 s on 2 cores)
def test_an_unreachable_mlflow_server_is_one_line_within_seconds_and_the_run_goes_on(
        no_accounts, silent_server, tmp_path, capsys):
    pytest.importorskip("mlflow")
    for uri in (f"http://127.0.0.1:{free_port()}", silent_server):
        start = time.monotonic()
        assert start_trackers(tmp_path / "run", mlflow_at(uri), {}, 0) == []
        assert time.monotonic() - start < SECONDS, uri
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(
            "lmforge: warning: metrics.tracker: mlflow could not start: "), lines
        assert lines[0].endswith("the run goes on without it")


def test_an_online_wandb_server_that_cannot_be_reached_is_one_line_within_seconds(
        no_accounts, monkeypatch, tmp_path, capsys):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{free_port()}")
    metrics = MetricsConfig(tracker="wandb", wandb_mode="online")
    start = time.monotonic()
    assert start_trackers(tmp_path / "run", metrics, {}, 0) == []
    assert time.monotonic() - start < SECONDS
    err = capsys.readouterr().err.strip()
    assert err.startswith("lmforge: warning: metrics.tracker: wandb could not start: http")
    assert "\n" not in err
    with pytest.raises(ConfigError, match=r"^metrics\.tracker: wandb could not start: .*"
                                          r"cannot be reached.*tracker_required=true"):
        check_trackers(MetricsConfig(tracker="wandb", wandb_mode="online",
                                     tracker_required=True))


def test_a_required_tracker_is_checked_only_when_required(no_accounts):
    check_trackers(mlflow_at(f"http://127.0.0.1:{free_port()}"))  # not required: no probe
    with pytest.raises(ConfigError, match=r"^metrics\.tracker: mlflow could not start: "
                                          r"http://127\.0\.0\.1:\d+ cannot be reached"):
        check_trackers(mlflow_at(f"http://127.0.0.1:{free_port()}", required=True))


def test_a_required_unreachable_tracker_refuses_the_run_before_its_directory_is_made(
        no_accounts, tiny_corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("LMFORGE_DEBUG", raising=False)
    run = tmp_path / "run"
    start = time.monotonic()
    code = main(["train", *tiny_overrides(tiny_corpus, 2), f"train.output_dir={run}",
                 "metrics.tracker=tensorboard,mlflow", "metrics.tracker_required=true",
                 f"metrics.mlflow_tracking_uri=http://127.0.0.1:{free_port()}"])
    assert time.monotonic() - start < SECONDS
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err, err
    assert err.startswith("lmforge: error: metrics.tracker: mlflow could not start: ")
    assert not run.exists()
