"""Reading a run's metrics.jsonl back."""
import pytest

from lmforge.perf.records import iter_numbers, read_metrics


def test_read_metrics_names_the_bad_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2"):
        read_metrics(tmp_path)
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        read_metrics(tmp_path / "nowhere")


def test_iter_numbers_keeps_only_finite_numbers():
    records = [{"step": 1, "mfu": None}, {"step": 2, "mfu": 0.5}, {"step": 3, "mfu": float("nan")},
               {"step": 4, "mfu": True}, {"step": 5}]
    assert iter_numbers(records, "mfu") == [(2, 0.5)]
