"""TensorMemoryTracker: live tensor storage and its peak, as the estimate's tests measure it."""
import torch

from lmforge.perf.tracker import TensorMemoryTracker


def test_tracker_counts_storage_once_and_sees_frees():
    tracker = TensorMemoryTracker()
    with tracker:
        a = torch.empty(1000, dtype=torch.float32)  # 4000 bytes
        view = a[10:]  # a view: no new storage
        b = a * 2  # 4000 more
        assert tracker.live == 8000
        del a  # the view keeps the storage alive
        assert tracker.live == 8000
        del view, b
    assert tracker.live == 0
    assert tracker.peak == 8000


def test_tracker_counts_tensors_made_before_it_only_when_told():
    before = torch.ones(256)
    tracker = TensorMemoryTracker()
    tracker.track([before])
    with tracker:
        moved = before.t()  # a view of a pre-existing tensor: nothing new
        assert tracker.live == 1024
        del moved
    del before
    assert tracker.live == 0
