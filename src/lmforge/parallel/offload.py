"""Activation offloading (``train.activation_offload``): the tensors a transformer block
saves for backward wait in host memory instead of on the GPU.

``offload_blocks`` runs each block's forward under
``torch.autograd.graph.saved_tensors_hooks``: the pack hook copies a saved tensor to
pinned CPU memory on a side stream and hands autograd a handle instead; the unpack hook
brings it back in backward. The embedding,
the head and the loss run outside the hooks: their tensors are needed first in backward,
so a round trip would only stall it.

What stays on the device (``keep_reason``): parameters (and autocast's copies of them,
which autograd would otherwise save: a weight is never offloaded), the positions and mask
every block is given, tensors under ``MIN_OFFLOAD_BYTES``, DTensors, views that do not
cover their memory densely, and tensors on another device. With activation checkpointing
a block saves only its inputs (``torch.utils.checkpoint`` saves them under these hooks,
and pushes its own hooks for the block's inner tensors, which take precedence), so those
inputs are what is offloaded; the recomputation in backward runs under checkpoint's hooks
alone, and its tensors, consumed at once, stay on the device.

On CUDA: device -> host copies go on one side stream, host -> device copies on another.
When backward first needs a block's tensors, all of that block's are brought back and the
previous block's copies start, so they overlap this block's backward (its recomputation,
with checkpointing). On the CPU the same code runs with plain synchronous copies: nothing
is saved, and the numbers are exactly those of a run without it, as on the GPU.
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor

from lmforge.models.attention import ContextParallel, DocumentMask

# Each copy has a fixed cost (two copy launches, two events, a pinned-buffer lookup: tens
# of microseconds), about the time 1 MiB takes over PCIe (~25 GB/s: 40 us). What is smaller
# is norm statistics, positions, rotary tables: a few KiB per block, against the block
# input's batch x seq x dim x 2 bytes (16 MiB for GPT-J-6B at 2048 tokens), so keeping it
# costs little memory and saves most of the copies.
MIN_OFFLOAD_BYTES = 2**20


@dataclass
class OffloadStats:
    """What the hooks did, summed since the offloader was built."""
    offloaded: int = 0  # tensors copied to host memory
    offloaded_bytes: int = 0
    shared: int = 0  # saves of memory already offloaded in the same block forward
    kept_small: int = 0
    kept_weights: int = 0
    kept_shared: int = 0  # positions, masks: inputs every block reads, alive all step anyway
    kept_other: int = 0  # DTensors, other subclasses, views that are not dense, other devices
    fetched: int = 0  # brought back when backward needed them
    prefetched: int = 0  # brought back ahead of use (the next block in backward)


class _Offloaded:
    """One saved tensor in host memory. Autograd holds (handle, size, stride) in its
    place: several views of one tensor share a handle."""

    def __init__(self, host: torch.Tensor, copied_out, device: torch.device, group: int):
        self.host = host
        self.copied_out = copied_out  # CUDA event: the host copy is complete
        self.device = device
        self.group = group  # the block forward that saved it
        self.uses = 1  # saves pointing here not yet unpacked
        self.on_device: Optional[torch.Tensor] = None  # the copy back, once issued
        self.ready = None  # CUDA event: on_device is complete


@dataclass
class _Group:
    """The tensors one block forward offloaded."""
    handles: list  # weak references: a graph that is dropped frees its tensors
    next_in_backward: Optional[int]  # the group backward needs after this one, if known


class ActivationOffloader:
    """The pack/unpack hooks and the bookkeeping of the blocks' offloaded tensors.

    ``device``: where the model computes (the tensors come back there). ``min_bytes``:
    the size threshold (default ``MIN_OFFLOAD_BYTES``; tests lower it for tiny models)."""

    def __init__(self, device: torch.device, min_bytes: Optional[int] = None):
        self.device = torch.device(device)
        self.min_bytes = MIN_OFFLOAD_BYTES if min_bytes is None else min_bytes
        self.stats = OffloadStats()
        self._cuda = self.device.type == "cuda"
        self._to_host = torch.cuda.Stream(self.device) if self._cuda else None
        self._to_device = torch.cuda.Stream(self.device) if self._cuda else None
        self._groups: dict[int, _Group] = {}  # by id, in forward order
        self._next_group = 0
        self._group: Optional[int] = None  # the block forward in progress
        self._kept_storages: dict[int, str] = {}  # storage -> keep reason, in this block
        # (storage, offset, numel, dtype) -> (tensor, handle) in the block forward in
        # progress (see ``pack``)
        self._seen: dict[tuple, tuple[torch.Tensor, _Offloaded]] = {}

    @contextlib.contextmanager
    def block(self, module: nn.Module, follows_previous: bool,
              shared_inputs: tuple = ()) -> Iterator[None]:
        """Run one block's forward with its saved tensors offloaded. ``follows_previous``:
        the block before it ran just before it in this forward (not the first block of a
        model or pipeline stage), so backward needs that one's tensors right after.
        ``shared_inputs``: tensors every block is given (positions, a mask): copying them
        would free nothing, and would move them once per block."""
        self._drop_dead_groups()
        previous = self._next_group - 1 if follows_previous else None
        self._group = self._next_group
        self._groups[self._group] = _Group([], previous)
        self._next_group += 1
        with torch.no_grad():  # (a DTensor's to_local would be recorded)
            self._kept_storages = {
                **{_storage_ptr(t): "kept_shared" for t in shared_inputs},
                **{_storage_ptr(p): "kept_weights" for p in module.parameters()}}
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield
        finally:
            self._group, self._kept_storages = None, {}
            self._seen.clear()

    # ---------------------------------------------------------------- forward: pack

    def pack(self, tensor: torch.Tensor):
        if isinstance(tensor, AsyncCollectiveTensor):
            # A collective's result not yet waited on (tensor parallelism's block input):
            # a plain tensor once it is complete.
            tensor = tensor.wait()
        reason = self.keep_reason(tensor)
        if reason is not None:
            setattr(self.stats, reason, getattr(self.stats, reason) + 1)
            return tensor
        # The same memory is often saved several times, through different views (the
        # input of q, k and v, each reshaped by linear): one copy serves them all. Holding
        # the tensor keeps its memory from going to another tensor during this forward.
        key = (_storage_ptr(tensor), tensor.storage_offset(), tensor.numel(), tensor.dtype)
        seen = self._seen.get(key)
        if seen is not None:
            handle = seen[1]
            handle.uses += 1
            self.stats.shared += 1
        else:
            handle = self._copy_to_host(tensor)
            self._seen[key] = (tensor, handle)
            self._groups[self._group].handles.append(weakref.ref(handle))
            self.stats.offloaded += 1
            self.stats.offloaded_bytes += tensor.numel() * tensor.element_size()
        return handle, tensor.size(), tensor.stride()

    def keep_reason(self, tensor: torch.Tensor) -> Optional[str]:
        """Why ``tensor`` stays on the device (an ``OffloadStats`` field), or None."""
        if isinstance(tensor, nn.Parameter) or _is_weight_copy(tensor):
            return "kept_weights"
        if isinstance(tensor, DTensor):
            # Under tensor parallelism the block inputs (the residual stream) are plain
            # local tensors and are offloaded; the DTensors inside a block stay.
            return "kept_other"
        if type(tensor) is not torch.Tensor or tensor.layout != torch.strided:
            return "kept_other"
        if _storage_ptr(tensor) in self._kept_storages:  # (or a view: weight.t())
            return self._kept_storages[_storage_ptr(tensor)]
        if tensor.device.type != self.device.type or not _dense(tensor):
            return "kept_other"
        if tensor.numel() * tensor.element_size() < self.min_bytes:
            return "kept_small"
        return None

    def _copy_to_host(self, tensor: torch.Tensor) -> _Offloaded:
        # The same strides as the original, so backward computes on an identical layout.
        host = torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype,
                                   device="cpu", pin_memory=self._cuda)
        copied_out = None
        if self._cuda:
            stream = self._to_host
            stream.wait_stream(torch.cuda.current_stream(self.device))  # tensor is written
            with torch.cuda.stream(stream):
                host.copy_(tensor, non_blocking=True)
                copied_out = stream.record_event()
            # Autograd drops the tensor now; its memory must not be reused before the
            # side stream has read it.
            tensor.record_stream(stream)
        else:
            host.copy_(tensor)
        return _Offloaded(host, copied_out, tensor.device, self._group)

    # -------------------------------------------------------------- backward: unpack

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed  # kept on the device
        packed, size, stride = packed
        if packed.on_device is None:
            packed.on_device = self._copy_to_device(packed)
            # the rest of this block's tensors are needed now too
            self.stats.fetched += 1 + self._bring_back(packed.group)
        group = self._groups.get(packed.group)
        if group is not None and group.next_in_backward is not None:
            self.stats.prefetched += self._bring_back(group.next_in_backward)
        tensor = packed.on_device
        if self._cuda:
            torch.cuda.current_stream(self.device).wait_event(packed.ready)
        packed.uses -= 1
        if packed.uses <= 0:
            packed.on_device = None  # autograd holds it as long as it needs it
        if (size, stride) != (tensor.size(), tensor.stride()):
            # another view of the same (dense) memory: the same elements, another shape
            tensor = tensor.as_strided(size, stride)
        return tensor

    def _bring_back(self, group: int) -> int:
        """Start copying back the tensors of ``group`` that backward has yet to use and
        that are not already on their way; returns how many."""
        entry, started = self._groups.get(group), 0
        for ref in entry.handles if entry is not None else ():
            handle = ref()
            if handle is None or handle.on_device is not None or handle.uses <= 0:
                continue
            handle.on_device = self._copy_to_device(handle)
            started += 1
        return started

    def _copy_to_device(self, handle: _Offloaded) -> torch.Tensor:
        host = handle.host
        # Allocated on the compute stream, so the memory comes from (and returns to) its
        # pool rather than one of the side stream's.
        tensor = torch.empty_strided(host.size(), host.stride(), dtype=host.dtype,
                                     device=handle.device)
        if not self._cuda:
            tensor.copy_(host)
            return tensor
        stream = self._to_device
        # The memory may have been freed by work still queued on the compute stream, and
        # the pinned buffer is complete only once its own copy out has finished. The
        # pinned buffer itself is not reused before this copy has read it: the caching
        # host allocator records an event for every non-blocking copy from pinned memory.
        stream.wait_stream(torch.cuda.current_stream(self.device))
        stream.wait_event(handle.copied_out)
        with torch.cuda.stream(stream):
            tensor.copy_(host, non_blocking=True)
            handle.ready = stream.record_event()
        tensor.record_stream(stream)
        return tensor

    def _drop_dead_groups(self) -> None:
        """Forget groups whose graph is gone (consumed by backward, or dropped)."""
        for group in [g for g, entry in self._groups.items()
                      if all(ref() is None for ref in entry.handles)]:
            del self._groups[group]


def offload_blocks(model: nn.Module, offloader: ActivationOffloader) -> None:
    """Offload what each transformer block of ``model`` (a model or pipeline stage)
    saves for backward. Applied after activation checkpointing (it wraps the
    checkpointed forward, so it sees the checkpoint's saved inputs) and, like it, by
    replacing the instance's forward: parameter names do not change, and FSDP2's hooks,
    which run around the forward, are untouched."""
    for position, layer in enumerate(model.layers.values()):
        _offload_forward(layer, offloader, follows_previous=position > 0)


def _offload_forward(layer: nn.Module, offloader: ActivationOffloader,
                     follows_previous: bool) -> None:
    inner = layer.forward

    def forward(*args, **kwargs):
        # A block takes (hidden states, positions, mask, cache): all but the hidden states
        # are the same tensors for every block (a mask object's too, once the first block
        # has built them).
        inputs = (*args[1:], *kwargs.values())
        shared = tuple(a for a in inputs if isinstance(a, torch.Tensor)) + tuple(
            t for a in inputs if isinstance(a, (DocumentMask, ContextParallel))
            for t in a.tensors())
        with offloader.block(layer, follows_previous, shared):
            return inner(*args, **kwargs)

    layer.forward = forward


def offload_summary(device: torch.device, checkpointing: str) -> str:
    """One line for the run log: what ``train.activation_offload`` moves, and where."""
    what = {"full": "the block inputs (activation checkpointing saves only those)",
            "selective": "the inputs of checkpointed blocks and the saved tensors of the "
                         "others",
            "none": "every tensor the blocks save for backward"}[checkpointing]
    where = ("pinned CPU memory on a side stream, prefetched one block ahead in backward"
             if torch.device(device).type == "cuda" else
             "a CPU copy (training on the CPU: no memory is saved)")
    return (f"activation offload: {what}, from {MIN_OFFLOAD_BYTES // 2**20} MiB up, to "
            f"{where}; weights, the head and the loss stay on the device")


def _storage_ptr(tensor: torch.Tensor) -> int:
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    return tensor.untyped_storage().data_ptr()


def _is_weight_copy(tensor: torch.Tensor) -> bool:
    """A copy of a parameter made in forward (autocast's cast to bf16): a weight too."""
    fn = tensor.grad_fn
    if fn is None or fn.name() != "ToCopyBackward0":
        return False
    return any(isinstance(getattr(source, "variable", None), nn.Parameter)
               for source, _ in fn.next_functions if source is not None)


def _dense(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s elements fill a block of memory exactly, in some dimension
    order: its copy then takes the same strides and no more memory. An expanded
    (stride 0) or strided slice is kept: copying it would materialise what it shares."""
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(tensor.stride(), tensor.shape)
                               if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True
