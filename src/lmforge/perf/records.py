"""``metrics.jsonl``, the record a training run writes (one JSON object per logged step),
read back for reports and tests. The writer is ``lmforge.train.metrics.MetricsLogger``."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable

METRICS_FILE = "metrics.jsonl"
# lm-eval results of a run (the end of training's, bench-eval's), which lmforge report reads
HARNESS_DIR = "harness"


def is_finite_number(value: Any) -> bool:
    """A value worth plotting or logging as a scalar: a finite int/float, not a bool."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The records of ``RUN_DIR/metrics.jsonl`` (or of a metrics.jsonl path), in order."""
    path = Path(run_dir)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no {METRICS_FILE} (is this a run directory?)")
    records = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not a JSON object ({e.msg})") from None
    return records


def iter_numbers(records: Iterable[dict], key: str) -> list[tuple[float, float]]:
    """(step, value) pairs of ``key`` where it is a finite number."""
    return [(r["step"], float(r[key])) for r in records if is_finite_number(r.get(key))]
