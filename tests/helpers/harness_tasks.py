"""A local lm-evaluation-harness multiple-choice task, as the harness tests write one: a
JSONL file of {question, choices, answer} rows and the task's YAML reading it (offline:
``dataset_path: json`` with local ``data_files``)."""
from __future__ import annotations

import json
from pathlib import Path

TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def task_yaml(name: str, data) -> str:
    return TASK.format(name=name, data=data)


def write_mc_task(folder: Path, name: str, rows: list[dict]) -> Path:
    """``folder``/``name``.yaml and its data ``folder``/``name``.jsonl; returns ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / f"{name}.yaml").write_text(task_yaml(name, data))
    return folder
