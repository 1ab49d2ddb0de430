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


def test_tracker_sees_storages_resized_in_place():
    """FSDP2 allocates and frees its unsharded parameters by resizing their storages in
    place, which no dispatched op shows: they count from the resize up to the one to 0."""
    made_before = torch.empty(1000)  # 4000 bytes, not tracked
    made_before.untyped_storage().resize_(0)  # (as a resharded parameter, before the step)
    shrunk = torch.empty(500)  # 2000 bytes, not tracked: never counted
    tracker = TensorMemoryTracker()
    with tracker:
        made_before.untyped_storage().resize_(4000)
        assert tracker.live == 4000
        shrunk.untyped_storage().resize_(0)
        assert tracker.live == 4000
        extra = torch.ones(250)  # 1000 bytes
        assert tracker.live == 5000
        made_before.untyped_storage().resize_(0)
        assert tracker.live == 1000
        made_before.untyped_storage().resize_(2000)
        assert tracker.live == 3000
        del extra
    assert "resize_" not in torch.UntypedStorage.__dict__  # put back on exit
    made_before.untyped_storage().resize_(4000)  # not tracked after exit
    assert (tracker.live, tracker.peak) == (2000, 5000)
    del made_before
    assert tracker.live == 0
