"""Measuring the memory the estimate predicts: live tensor bytes and their peak, on any
device, seen at the dispatcher. This is how the estimate is checked on CPU
(tests/unit/perf/test_estimate_measured.py); on a GPU it is the counterpart of
``torch.cuda.max_memory_allocated``."""
from __future__ import annotations

import weakref

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

class TensorMemoryTracker(TorchDispatchMode):
    """Live bytes of tensor storage, and their peak, while the mode is active.

    Every op's outputs are seen at the dispatcher (forward, backward, optimizer); a
    storage counts from the op that created it until Python frees it (a weakref
    finalizer on the storage). Views share their base's storage and count once. Tensors
    made before the mode count only once passed to ``track`` (parameters, optimizer
    state, the batch). A storage resized in place (``UntypedStorage.resize_``, which is no
    dispatched op: FSDP2 allocates each unsharded parameter so when it gathers a unit and
    frees it so when it reshards) counts at its new size from the resize on, whoever made
    it. Kernel-internal scratch (e.g. inside a fused attention kernel) is not a tensor and
    is not seen."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}

    def track(self, tensors) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._register(t)

    def _register(self, t: torch.Tensor) -> None:
        if t.device.type == "meta":
            return
        owner = _owner(t)
        key = id(owner)
        nbytes = owner.nbytes() if not t.is_mkldnn else t.numel() * t.element_size()
        old = self._sizes.get(key)
        if old is None:
            self._sizes[key] = nbytes
            self.live += nbytes
            weakref.finalize(owner, self._free, key)
        elif old != nbytes:  # resized in place
            self._sizes[key] = nbytes
            self.live += nbytes - old
        self.peak = max(self.peak, self.live)

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def _resized(self, storage) -> None:
        """``storage`` was resized in place: a storage not counted yet counts from now
        (none made before the mode and only shrunk: its bytes were never counted)."""
        key, nbytes = id(storage), storage.nbytes()
        old = self._sizes.get(key)
        if old is None:
            if nbytes == 0:
                return
            self._sizes[key] = nbytes
            self.live += nbytes
            weakref.finalize(storage, self._free, key)
        else:
            self._sizes[key] = nbytes
            self.live += nbytes - old
        self.peak = max(self.peak, self.live)

    def __enter__(self):
        # (the class's own attribute, if an enclosing tracker set one, to put back)
        self._outer_resize = torch.UntypedStorage.__dict__.get("resize_")
        resize = torch.UntypedStorage.resize_

        def resized(storage, size):
            out = resize(storage, size)
            self._resized(storage)
            return out
        torch.UntypedStorage.resize_ = resized
        return super().__enter__()

    def __exit__(self, *exc):
        if self._outer_resize is None:
            del torch.UntypedStorage.resize_
        else:
            torch.UntypedStorage.resize_ = self._outer_resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {id(_owner(t)) for t in _tensors((args, kwargs))}
        out = func(*args, **(kwargs or {}))
        for t in _tensors(out):
            key = id(_owner(t))
            if key not in inputs or key in self._sizes:
                self._register(t)
        return out


def _owner(t: torch.Tensor):
    """What holds ``t``'s bytes: its storage, or the tensor itself for an opaque one
    (oneDNN's packed weights, ``models/packed_linear.py``, expose no storage); a
    DTensor's, its local tensor's (FSDP's shards, expert parallelism's experts); a
    functional collective's result not yet waited on (``AsyncCollectiveTensor``: tensor
    parallelism's row-parallel outputs), the result's: neither wrapper holds memory of
    its own, and each view of one would count again."""
    if isinstance(t, AsyncCollectiveTensor):
        t = t.elem
    if isinstance(t, DTensor):
        t = t.to_local()
    return t if t.is_mkldnn else t.untyped_storage()


def _tensors(tree) -> list[torch.Tensor]:
    """The real (non-meta) tensors in nested tuples/lists/dicts."""
    if isinstance(tree, torch.Tensor):
        return [] if tree.device.type == "meta" else [tree]
    if isinstance(tree, (list, tuple)):
        return [t for item in tree for t in _tensors(item)]
    if isinstance(tree, dict):
        return [t for item in tree.values() for t in _tensors(item)]
    return []
