"""metrics.tracker for real: MLflow (its SQLite store beside the run directory, and an
``mlflow server`` the test starts on localhost) read back with MLflow's client, and W&B
offline read back with W&B's own reader of its run file (``wandb leet inspect --json``).
Every number in metrics.jsonl is in the tracker at its step; the config, the summary and
the plots are there; a resumed run continues the same tracked run; rank 0 alone logs; a
tracker that fails to start is one line and the run goes on, or stops with
metrics.tracker_required."""
from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from helpers.runs import (free_port, read_metrics, run_lmforge, tiny_corpus,  # noqa: F401
                          tiny_overrides)
from lmforge.config import ConfigError, load_config
from lmforge.perf.records import is_finite_number
from lmforge.train.metrics import tensorboard_tag

mlflow = pytest.importorskip("mlflow")
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_accounts")]


@pytest.fixture
def no_accounts(monkeypatch):
    """No W&B account (so W&B runs offline) and no MLflow server but the test's."""
    for name in ("WANDB_API_KEY", "WANDB_MODE", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")


def logged(run_dir: Path) -> dict[str, dict[int, float]]:
    """metrics.jsonl's numbers as the trackers name them: tag -> {step: value}."""
    out: dict = {}
    for record in read_metrics(run_dir):
        for key, value in record.items():
            if key != "step" and is_finite_number(value):
                out.setdefault(tensorboard_tag(key), {})[record["step"]] = float(value)
    return out


def mlflow_runs(uri: str) -> list:
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("lmforge")
    return client, client.search_runs([experiment.experiment_id])


def assert_mlflow_holds(client, run, run_dir: Path) -> None:
    expected = logged(run_dir)
    assert set(run.data.metrics) == set(expected)
    for tag, by_step in expected.items():
        history = client.get_metric_history(run.info.run_id, tag)
        assert {m.step: m.value for m in history} == pytest.approx(by_step, rel=1e-6), tag
        assert len(history) == len(by_step), tag  # each step once
    assert run.data.params["optim.lr"] == str(load_config(str(run_dir / "config.yaml")).optim.lr)


@pytest.mark.long  # (16 s: make test-long; the other MLflow and wandb tests stay)
def test_mlflow_holds_every_metric_the_config_summary_and_plots_across_a_resume(
        tiny_corpus, tmp_path):
    run_dir = tmp_path / "runs" / "x"
    base = tiny_overrides(tiny_corpus, 4) + ["metrics.tracker=tensorboard,mlflow"]
    run_lmforge(run_dir, base + ["train.stop_at_step=2"])
    run_lmforge(run_dir, base + ["train.resume=auto"])
    client, runs = mlflow_runs(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    assert len(runs) == 1 and runs[0].info.run_name == "x"  # the resume continued it
    assert runs[0].info.status == "FINISHED"
    assert_mlflow_holds(client, runs[0], run_dir)
    assert sorted(logged(run_dir)["loss/loss"]) == [1, 2, 3, 4]
    artifacts = {a.path for a in client.list_artifacts(runs[0].info.run_id)}
    plots = {a.path for a in client.list_artifacts(runs[0].info.run_id, "plots")}
    assert {"summary.json", "plots"} <= artifacts and "plots/loss_vs_step.png" in plots
    local = client.download_artifacts(runs[0].info.run_id, "summary.json", str(tmp_path))
    assert json.loads(Path(local).read_text()) == json.loads(
        (run_dir / "summary.json").read_text())



@pytest.fixture
def mlflow_server(tmp_path):
    port = free_port()
    cli = Path(sys.executable).parent / "mlflow"
    proc = subprocess.Popen([str(cli), "server", "--host", "127.0.0.1", "--port", str(port),
                             "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
                             "--default-artifact-root", (tmp_path / "artifacts").as_uri(),
                             "--workers", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            break
        except OSError:
            assert proc.poll() is None and time.time() < deadline, "mlflow server did not start"
            time.sleep(0.5)
    yield url
    proc.terminate()
    proc.wait(timeout=30)


@pytest.mark.long  # (25 s with its server: make test-long)
def test_an_mlflow_server_gets_a_2_process_runs_metrics_from_rank_0_alone(
        tiny_corpus, tmp_path, mlflow_server):
    run_dir = tmp_path / "x"
    run_lmforge(run_dir, tiny_overrides(tiny_corpus, 3) + [
        "metrics.tracker=mlflow", f"metrics.mlflow_tracking_uri={mlflow_server}",
        "metrics.run_name=two-ranks"], nproc=2)
    client, runs = mlflow_runs(mlflow_server)
    assert [r.info.run_name for r in runs] == ["two-ranks"]
    assert_mlflow_holds(client, runs[0], run_dir)


def test_wandb_offline_holds_every_metric_and_the_config(tiny_corpus, tmp_path):
    pytest.importorskip("wandb")
    run_dir = tmp_path / "x"
    run_lmforge(run_dir, tiny_overrides(tiny_corpus, 3) + ["metrics.tracker=wandb"])
    (run_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")  # offline: no API key
    proc = subprocess.run([str(Path(sys.executable).parent / "wandb"), "leet", "inspect",
                           "--json", str(run_file)], capture_output=True, text=True,
                          timeout=120)
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    history: dict = {}
    for r in records:
        if r.get("type") == "history":
            item = r["history"]["item"]
            for tag, value in item.items():
                if not tag.startswith("_"):
                    history.setdefault(tag, {})[item["_step"]] = value
    expected = logged(run_dir)
    plots = {tag.split(".")[0] for tag in history if tag.startswith("plots/")}
    assert "plots/loss_vs_step" in plots  # the run's plots, as images
    assert set(history) - {tag for tag in history if tag.startswith("plots/")} == set(expected)
    for tag, by_step in expected.items():
        assert history[tag] == pytest.approx(by_step, rel=1e-6), tag
    config = next(r["run"]["config"] for r in records if r.get("type") == "run")
    assert "optim" in json.dumps(config)
    assert not list(run_dir.glob("tensorboard"))  # only the trackers named


@pytest.mark.long  # (make test-long: a whole run, about 12 s on 2 cores)
def test_a_tracker_that_fails_to_start_is_one_line_and_the_run_goes_on(tiny_corpus, tmp_path):
    bad = tiny_overrides(tiny_corpus, 2) + ["metrics.tracker=tensorboard,mlflow",
                                            "metrics.mlflow_tracking_uri=nowhere://x"]
    proc = run_lmforge(tmp_path / "goes-on", bad)
    warnings = [l for l in proc.stderr.splitlines() if "metrics.tracker: mlflow" in l]
    assert len(warnings) == 1 and "could not start" in warnings[0], proc.stderr[-2000:]
    assert [r["step"] for r in read_metrics(tmp_path / "goes-on")] == [1, 2]
    assert (tmp_path / "goes-on" / "tensorboard").is_dir()
    proc = run_lmforge(tmp_path / "stops", bad + ["metrics.tracker_required=true"],
                       check=False)
    errors = [l for l in proc.stderr.splitlines() if "lmforge: error" in l]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
    assert "metrics.tracker: mlflow could not start" in errors[0]
    assert "metrics.tracker_required=true" in errors[0]


@pytest.mark.parametrize("value,message", [("tensorboard,neptune", "neptune is not one of"),
                                           ("[1, 2]", "is not a list of tracker names")])
def test_an_unknown_tracker_is_refused_naming_the_key(value, message):
    with pytest.raises(ConfigError, match=f"metrics.tracker: .*{message}"):
        load_config(None, [f"metrics.tracker={value}"]).validate()
