"""Where a run's metrics go besides ``metrics.jsonl`` (``metrics.tracker``; docs/metrics.md):
TensorBoard, MLflow and Weights & Biases, each behind the same three calls: ``log`` a step's
numbers, ``finish`` with the summary and the run's plots, ``close``.

Only the logging rank starts trackers (``MetricsLogger``). A tracker that fails to start,
or later, is one line on stderr and the run goes on with the others; with
``metrics.tracker_required`` the run stops there instead. A resumed run continues the same
MLflow and W&B runs: their ids are kept in ``RUN/trackers.json``.

A tracker's server is probed before it starts (``unreachable``: a TCP connection, a few
seconds at most), and MLflow's first requests are not retried for minutes: a server that
cannot be reached is one line within seconds, not a silent stall before step 1. With
``metrics.tracker_required`` that probe runs before the run is set up
(``check_trackers``, from ``train``'s checks), so nothing is written."""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Optional
from urllib.parse import urlsplit

from lmforge import fsio
from lmforge.config import ConfigError, tracker_names

IDS_FILE = "trackers.json"  # the MLflow run id and the W&B run id a resumed run continues
WANDB_ENV = "LMFORGE_WANDB_PROJECT"  # the W&B project where metrics.wandb_project is unset
PARAM_CHARS = 6000  # MLflow's longest parameter value
BATCH = 100  # parameters per MLflow log_batch call (its limit)
PROBE_S = 5.0  # how long a tracker's server has to accept a connection
# MLflow's requests while it starts: no retries, a short timeout (its defaults retry for
# about 4 minutes; a run's later logging keeps them, riding out a server's restart).
MLFLOW_START = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


class TensorBoard:
    name = "tensorboard"

    def __init__(self, out_dir: Path, start_step: int):
        from torch.utils.tensorboard import SummaryWriter  # (only when asked for)

        # purge_step: TensorBoard hides the events of the steps a resumed run repeats
        self.writer = SummaryWriter(str(out_dir / "tensorboard"),
                                    purge_step=start_step + 1 if start_step else None)

    def log(self, step: int, numbers: dict[str, float]) -> None:
        for tag, value in numbers.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def finish(self, summary: dict, plots: list[Path]) -> None:
        pass  # (the event files are the record)

    def close(self) -> None:
        self.writer.close()


class MLflow:
    """One MLflow run per lmforge run: the resolved config as parameters (``section.key``),
    every logged number at its step, the summary (``summary.json``) and the plots as
    artifacts. The store: ``metrics.mlflow_tracking_uri``, else ``MLFLOW_TRACKING_URI``,
    else an SQLite file beside the run directory (``runs/mlflow.db`` for ``runs/x``), so
    that the runs under one folder share it."""
    name = "mlflow"

    def __init__(self, out_dir: Path, metrics, config: dict, ids: dict):
        from mlflow.tracking import MlflowClient  # (only when asked for)

        parent = out_dir.resolve().parent
        self.uri = (metrics.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
                    or f"sqlite:///{parent / 'mlflow.db'}")
        self.client = MlflowClient(tracking_uri=self.uri)
        self.run_id = ids.get("run_id") if ids.get("tracking_uri") == self.uri else None
        with _env_default(MLFLOW_START):
            self._start(out_dir, metrics, config, parent)

    def _start(self, out_dir: Path, metrics, config: dict, parent: Path) -> None:
        """The MLflow run: a new one with the config, or the resumed run's, running."""
        from mlflow.entities import Param  # (only when asked for)

        if self.run_id is None:
            experiment = self.client.get_experiment_by_name(metrics.mlflow_experiment)
            experiment_id = experiment.experiment_id if experiment else \
                self.client.create_experiment(metrics.mlflow_experiment,
                                              artifact_location=_artifact_root(self.uri, parent))
            run = self.client.create_run(experiment_id,
                                         run_name=metrics.run_name or out_dir.name)
            self.run_id = run.info.run_id
            params = [Param(k, str(v)[:PARAM_CHARS]) for k, v in _flat(config).items()]
            for i in range(0, len(params), BATCH):
                self.client.log_batch(self.run_id, params=params[i:i + BATCH])
        else:  # a resumed run: the same MLflow run, running again
            self.client.update_run(self.run_id, status="RUNNING")

    def ids(self) -> dict:
        return {"run_id": self.run_id, "tracking_uri": self.uri}

    def log(self, step: int, numbers: dict[str, float]) -> None:
        from mlflow.entities import Metric  # (only when asked for)

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(tag, value, now, step)
                                                    for tag, value in numbers.items()])

    def finish(self, summary: dict, plots: list[Path]) -> None:
        self.client.log_dict(self.run_id, summary, "summary.json")
        for plot in plots:
            self.client.log_artifact(self.run_id, str(plot), "plots")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class WandB:
    """A W&B run: the config, every logged number at its step, the summary and the plots.
    Offline (files under ``RUN/wandb``, ``wandb sync`` uploads them later) where
    ``metrics.wandb_mode`` or ``WANDB_MODE`` says so, or where no ``WANDB_API_KEY`` is set."""
    name = "wandb"

    def __init__(self, out_dir: Path, metrics, config: dict, ids: dict):
        import wandb  # (only when asked for)

        mode = wandb_mode(metrics)
        project = metrics.wandb_project or os.environ.get(WANDB_ENV) or "lmforge"
        self.run = wandb.init(project=project, name=metrics.run_name or out_dir.name,
                              dir=str(out_dir), config=config, mode=mode,
                              id=ids.get("id"), resume="allow" if ids.get("id") else None)
        self.wandb = wandb

    def ids(self) -> dict:
        return {"id": self.run.id}

    def log(self, step: int, numbers: dict[str, float]) -> None:
        self.run.log(numbers, step=step)

    def finish(self, summary: dict, plots: list[Path]) -> None:
        self.run.summary.update({k: v for k, v in summary.items()
                                 if isinstance(v, (int, float, str))})
        images = {f"plots/{p.stem}": self.wandb.Image(str(p)) for p in plots
                  if p.suffix == ".png"}
        if images:
            self.run.log(images)

    def close(self) -> None:
        self.run.finish()


def wandb_mode(metrics) -> str:
    return metrics.wandb_mode or os.environ.get("WANDB_MODE") or (
        "online" if os.environ.get("WANDB_API_KEY") else "offline")


def start_trackers(out_dir: Path, metrics, config: dict, start_step: int) -> list:
    """The trackers ``metrics.tracker`` names, started (those that fail: one line each,
    or a ``ConfigError`` with ``metrics.tracker_required``)."""
    ids = read_ids(out_dir)
    started = []
    for name in tracker_names(metrics.tracker):
        if (reason := unreachable(name, metrics)) is not None:
            failed(name, "could not start", ConnectionError(reason), metrics.tracker_required)
            continue
        try:
            if name == "tensorboard":
                tracker = TensorBoard(out_dir, start_step)
            elif name == "mlflow":
                tracker = MLflow(out_dir, metrics, config, ids.get("mlflow", {}))
            else:
                tracker = WandB(out_dir, metrics, config, ids.get("wandb", {}))
        except Exception as exc:  # (any failure: an import, a server, a store)
            failed(name, "could not start", exc, metrics.tracker_required)
            continue
        started.append(tracker)
    write_ids(out_dir, {t.name: t.ids() for t in started if hasattr(t, "ids")})
    return started


def check_trackers(metrics) -> None:
    """With ``metrics.tracker_required``, what ``start_trackers`` would refuse, refused
    before the run is set up: a tracker not installed, a server that cannot be reached."""
    if not metrics.tracker_required:
        return  # (a tracker that fails then is one line, and the run goes on)
    for name in tracker_names(metrics.tracker):
        module = "torch.utils.tensorboard" if name == "tensorboard" else name
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:  # (tensorboard's parent, torch, is there; its own may not be)
            found = False
        if not found:
            failed(name, "could not start", ImportError(f"No module named {module!r}"), True)
        if (reason := unreachable(name, metrics)) is not None:
            failed(name, "could not start", ConnectionError(reason), True)


def unreachable(name: str, metrics) -> Optional[str]:
    """Why tracker ``name``'s server does not accept a connection within ``PROBE_S``
    seconds, or None (it does, or the tracker keeps files here)."""
    url = _server_url(name, metrics)
    if url is None:
        return None
    parts = urlsplit(url)
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        socket.create_connection((parts.hostname, port), timeout=PROBE_S).close()
    except (OSError, ValueError) as e:  # (ValueError: a port that is not a number)
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        return f"{url} cannot be reached ({reason or type(e).__name__})"
    return None


def _server_url(name: str, metrics) -> Optional[str]:
    """The http(s) address tracker ``name`` would send to, if it sends anywhere."""
    if name == "mlflow":
        url = metrics.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or ""
    elif name == "wandb" and wandb_mode(metrics) == "online":
        url = _wandb_base_url()
    else:
        return None
    return url if urlsplit(url).scheme in ("http", "https") and urlsplit(url).hostname \
        else None


def _wandb_base_url() -> str:
    """W&B's server as ``wandb.init`` finds it (its settings files, then WANDB_BASE_URL);
    "" when W&B is not installed or cannot say (then it is not probed)."""
    try:
        import wandb  # (only when asked for)

        settings = wandb.Settings()
        settings.update_from_system_settings()
        settings.update_from_env_vars(dict(os.environ))
        return str(settings.base_url or "")
    except Exception:  # (W&B's own start reports whatever is wrong with it)
        return ""


@contextlib.contextmanager
def _env_default(values: dict[str, str]):
    """``values`` in the environment where the user set none, for the block only."""
    added = [k for k in values if k not in os.environ]
    os.environ.update({k: values[k] for k in added})
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def failed(name: str, what: str, exc: BaseException, required: bool) -> None:
    """One line for a tracker that failed; a ``ConfigError`` when trackers are required."""
    reason = " ".join(str(exc).split())[:300] or type(exc).__name__
    if isinstance(exc, ImportError):
        reason += f" (pip install {name})"
    if required:
        raise ConfigError(f"metrics.tracker: {name} {what}: {reason} "
                          f"(metrics.tracker_required=true)")
    print(f"lmforge: warning: metrics.tracker: {name} {what}: {reason}; the run goes on "
          f"without it", file=sys.stderr, flush=True)


def read_ids(out_dir: Path) -> dict:
    try:
        ids = json.loads((out_dir / IDS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return ids if isinstance(ids, dict) else {}


def write_ids(out_dir: Path, ids: dict) -> None:
    if ids:
        fsio.atomic_write_bytes(out_dir / IDS_FILE, json.dumps({**read_ids(out_dir), **ids},
                                                               indent=2).encode())


def _artifact_root(uri: str, parent: Path) -> Optional[str]:
    """Where a new experiment keeps its artifacts: beside the SQLite store this module
    chose (MLflow's default is relative to the working directory); a server's or another
    store's own default elsewhere."""
    if uri == f"sqlite:///{parent / 'mlflow.db'}":
        return (parent / "mlartifacts").as_uri()
    return None


def _flat(config: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
