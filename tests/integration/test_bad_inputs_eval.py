"""Bad inputs of the benchmarks and trackers a run reaches out to (issue 37, point 6:
refuse early, never hang silently): an lm-eval task whose data is not on this machine,
is empty or cannot be read is refused in one line naming the task, by ``bench-eval``
before the model loads and by ``train`` (``eval.harness_tasks``) before step 1 and
before the run directory is made (it used to be after the last step, with no
summary.json, and an empty file was a StopIteration traceback); bench-eval makes no
network request (it made 6 to the hub before refusing); a required tracker whose server
cannot be reached is refused within seconds (MLflow retried a closed port for 4 minutes
before step 1). Harness and rules: tests/helpers/bad_inputs.py."""
from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from helpers.bad_inputs import Bad, check_refused, fifo, params, steps, write
from helpers.harness_tasks import task_yaml
from helpers.runs import free_port

needs_lm_eval = pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None,
                                   reason="lm-evaluation-harness is not installed")
ROW = {"question": "what is the sky", "choices": [" blue", " green"], "answer": 0}


def task(data: str | bytes | None = None, name: str = "t", edit=lambda y: y,
         data_name: str = "t.jsonl"):
    """A setup: ``{tmp}/tasks/<name>.yaml`` reading ``{tmp}/tasks/<data_name>``, which holds
    ``data`` (None: it is not written; the YAML passes through ``edit``)."""
    def setup(tmp, assets):
        folder = tmp / "tasks"
        folder.mkdir(exist_ok=True)
        if data is not None:
            write(f"tasks/{data_name}", data)(tmp, assets)
        (folder / f"{name}.yaml").write_text(edit(task_yaml(name, folder / data_name)))
    return setup


ONE_ROW = json.dumps(ROW) + "\n"
BENCH = ["bench-eval", "--model", "{model}", "--tasks", "t", "--include-path", "{tmp}/tasks",
         "--device", "cpu", "--output", "{tmp}/out.json"]
NOT_HERE = (r"its data is not on this machine \(.*\); point the task's YAML at local files "
            r"\(dataset_path: json, .*\) and give its folder as ")
TRAIN = ["train", "model.init_from={model}", "data.kind=text", "data.path={text}",
         "data.seq_len=16", "train.max_steps=1", "train.device=cpu",
         "train.output_dir={tmp}/run"]
HARNESS = [*TRAIN, "eval.harness_tasks=t", "eval.harness_include_path={tmp}/tasks"]


def hub(yaml: str) -> str:
    return yaml.replace("dataset_path: json", "dataset_path: someone/not-on-this-machine")


TABLE = [
    # bench-eval: the task's data, checked before the model loads
    Bad("bench-eval task whose data file is missing", BENCH, r"^--tasks: t: " + NOT_HERE
        + r"--include-path$", setup=task(None)),
    Bad("bench-eval task whose data file is empty", BENCH,
        r"^--tasks: t: its data has no documents to score$", setup=task("")),
    Bad("bench-eval task whose data is blank lines", BENCH,
        r"^--tasks: t: lm-eval cannot load it \(ValueError: .*no data", setup=task("\n \n")),
    Bad("bench-eval task whose data is not JSON", BENCH,
        r"^--tasks: t: lm-eval cannot load it \(DatasetGenerationError: .*JSON parse error",
        setup=task('{"question": "q",\n')),
    Bad("bench-eval task whose split is not in its data", BENCH,
        r"^--tasks: t: lm-eval cannot load it \(KeyError: 'validation'\)",
        setup=task(ONE_ROW, edit=lambda y: y.replace("test_split: test",
                                                     "test_split: validation"))),
    Bad("bench-eval task whose rows lack a field", BENCH,
        r"^--tasks: t: lm-eval cannot load it \(UndefinedError: 'question' is undefined\)",
        setup=task(json.dumps({"q": "x", "choices": [" a"], "answer": 0}) + "\n")),
    Bad("bench-eval task whose data is a FIFO", BENCH, r"^--tasks: t: " + NOT_HERE,
        setup=steps(task(None), fifo("tasks/t.jsonl"))),
    Bad("bench-eval task whose data is on the hub", BENCH,
        r"^--tasks: t: its data is not on this machine \(.*someone/not-on-this-machine",
        setup=task(None, edit=hub)),
    Bad("bench-eval group of an empty task", [*BENCH[:4], "g", *BENCH[5:]],
        r"^--tasks: g: its data has no documents to score$",
        setup=steps(task(""), write("tasks/g.yaml", "group: g\ntask:\n  - t\n"))),
    # train: eval.harness_tasks, checked before the run directory is made
    Bad("harness task whose data file is missing", HARNESS,
        r"^eval\.harness_tasks: t: " + NOT_HERE + r"eval\.harness_include_path$",
        setup=task(None)),
    Bad("harness task whose data file is empty", HARNESS,
        r"^eval\.harness_tasks: t: its data has no documents to score$", setup=task("")),
    Bad("harness task whose data is on the hub", HARNESS,
        r"^eval\.harness_tasks: t: its data is not on this machine", setup=task(None, edit=hub)),
]
TABLE = [Bad(r.name, r.argv, r.message, r.setup, marks=(needs_lm_eval,)) for r in TABLE] + [
    # trackers: a required one whose server is a closed port on this machine
    Bad("required mlflow tracker on a closed port",
        [*TRAIN, "metrics.tracker=mlflow", "metrics.tracker_required=true",
         f"metrics.mlflow_tracking_uri=http://127.0.0.1:{free_port()}"],
        r"^metrics\.tracker: mlflow could not start: http://127\.0\.0\.1:\d+ cannot be "
        r"reached \(.*\) \(metrics\.tracker_required=true\)$"),
]


@pytest.mark.parametrize("row", params(TABLE))
def test_eval_input_is_refused_in_one_line(row, bad_input_assets, tmp_path, capsys,
                                           monkeypatch):
    monkeypatch.delenv("LMFORGE_DEBUG", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    start = time.monotonic()
    check_refused(row, bad_input_assets, tmp_path, capsys)
    assert time.monotonic() - start < 60  # refused early: no retries, no training


@pytest.fixture
def connections(monkeypatch) -> list:
    """Every attempt to open a connection, recorded and failed loudly."""
    attempts = []

    def refuse(address, *args, **kwargs):
        attempts.append(address)
        raise OSError(f"test: no network ({address})")

    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", lambda self, address: refuse(address))
    monkeypatch.setattr(socket.socket, "connect_ex", lambda self, address: refuse(address))
    return attempts


@needs_lm_eval
@pytest.mark.parametrize("tasks", ["t", "hellaswag"])  # a task of ours, one of lm-eval's
def test_bench_eval_makes_no_network_request(tasks, bad_input_assets, tmp_path, capsys,
                                            monkeypatch, connections):
    """As in a process where the hub and datasets were imported online before bench-eval
    ran (the switches they read at import are off)."""
    import datasets.config
    import huggingface_hub.constants

    from lmforge.cli import main

    for name in ("LMFORGE_DEBUG", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE",
                 "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", False)
    task(None, edit=hub)(tmp_path, bad_input_assets)
    code = main(["bench-eval", "--model", str(bad_input_assets["model"]), "--tasks", tasks,
                 "--include-path", str(tmp_path / "tasks"), "--device", "cpu"])
    err = capsys.readouterr().err.strip()
    assert connections == []
    assert code == 2 and "\n" not in err, err[-2000:]
    assert err.startswith(f"lmforge: error: --tasks: {tasks}: its data is not on this machine")


NO_NETWORK = """
import socket, sys
def refuse(address, *args, **kwargs):
    print(f"connection attempt: {address}", file=sys.stderr)
    raise OSError("test: no network")
socket.create_connection = refuse
socket.socket.connect = lambda self, address: refuse(address)
from lmforge.cli import main
sys.exit(main(sys.argv[1:]))
"""


@needs_lm_eval
@pytest.mark.slow
def test_a_fresh_bench_eval_process_makes_no_network_request(bad_input_assets, tmp_path):
    """In a process of its own, the hub's and datasets' switches are set before they are
    imported (in the test process above, some test may have imported them first)."""
    task(None, edit=hub)(tmp_path, bad_input_assets)
    # (not the switches this process may have set: the child must set them itself)
    env = {k: v for k, v in os.environ.items() if k not in (
        "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "LMFORGE_DEBUG")}
    proc = subprocess.run(
        [sys.executable, "-c", NO_NETWORK, "bench-eval", "--model",
         str(bad_input_assets["model"]), "--tasks", "t", "--include-path",
         str(tmp_path / "tasks"), "--device", "cpu"],
        capture_output=True, text=True, timeout=300, env=env)
    assert "connection attempt" not in proc.stderr, proc.stderr[-2000:]
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert "its data is not on this machine" in proc.stderr
