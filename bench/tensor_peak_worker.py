"""``lmforge train`` with its second forward-backward watched by the allocator: the peak
of allocated memory of this process during that step, the quantity ``lmforge estimate``
predicts (peak allocated), written to ``$LMFORGE_TENSOR_PEAK_DIR/rank<R>.json``.

Why not the trainer's own figure: on a CPU ``peak_mem_gib`` is the process's peak RSS
(interpreter, libraries, allocator caches), which the estimate's tensor terms do not model.
Why not TensorMemoryTracker: it sees dispatched ops and in-place storage resizes
(FSDP2's unsharded parameters), not what the communication library allocates and frees
on its own threads; the profiler's memory events come from the allocator and see every
allocation and free.

measured = the bytes of this rank's parameters, gradients and optimizer states when the
step starts + the largest net allocation during it. Tensors that merely stay alive across
the step and are none of those (the corpus's token tensors, on a GPU host memory) are left
out, as the estimate leaves them out. Used by bench/plan_check.py as ``torchrun
bench/tensor_peak_worker.py [CONFIG] key=value ...``; the profiler slows the step, so step
times come from separate, unwatched runs."""
import gc
import json
import os
import sys
from pathlib import Path

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from lmforge.cli.common import config_and_overrides  # noqa: E402
from lmforge.config import load_config  # noqa: E402
from lmforge.train.loop import train  # noqa: E402
from lmforge.train.model_setup import TrainModel  # noqa: E402

WATCHED_CALL = 2  # the first step creates the optimizer state
RECORD: dict = {"calls": 0}


def training_state_bytes(model: TrainModel) -> dict:
    """Bytes of this rank's parameters, gradients and optimizer states, each storage once
    (DTensors by their local shard)."""
    seen, sizes = set(), {"params": 0, "grads": 0, "optimizer": 0}

    def add(kind, t):
        if isinstance(t, torch.Tensor):
            local = t.to_local() if hasattr(t, "to_local") else t
            storage = local.untyped_storage()
            if id(storage) not in seen:
                seen.add(id(storage))
                sizes[kind] += storage.nbytes()
    for p in model.parameters():
        add("params", p)
        add("grads", p.grad)
    for obj in gc.get_objects():
        if isinstance(obj, torch.optim.Optimizer):
            for state in obj.state.values():
                for value in state.values():
                    add("optimizer", value)
    return sizes


def largest_net_allocation(prof) -> int:
    """The peak of live bytes allocated during the profile, from the allocator's events
    by address. The profiler records the profiled threads only, so a buffer that the
    transport's own thread frees (gloo drops its work's tensors there) has no free event:
    one a collective allocated inside its own call is taken as freed when the call
    returns (a staging copy); any other, when the allocator hands its address out again."""
    events = []  # (time, +bytes or -bytes, address)

    def walk(node, collective_end):
        if node.tag == _EventType.Allocation:
            f = node.extra_fields
            events.append((node.start_time_ns, f.alloc_size, f.ptr, collective_end))
        elif node.name.startswith("c10d::"):
            collective_end = node.end_time_ns
        for child in node.children:
            walk(child, collective_end)
    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root, None)
    events.sort(key=lambda e: e[0])
    freed = _frees_seen(events)
    timeline = []
    for i, (time, size, ptr, collective_end) in enumerate(events):
        timeline.append((time, size, ptr))
        if size > 0 and i not in freed and collective_end is not None:
            timeline.append((collective_end, -size, ptr))
    live: dict[int, int] = {}
    running = peak = 0
    for _, size, ptr in sorted(timeline, key=lambda e: e[0]):
        if size > 0:
            running += size - live.pop(ptr, 0)
            live[ptr] = size
        else:  # a free: of a buffer allocated during the profile, or before it
            running -= live.pop(ptr, -size)
        peak = max(peak, running)
    return peak


def _frees_seen(events) -> set[int]:
    """Indices of the allocations whose free event the profile holds."""
    open_at: dict[int, int] = {}
    seen = set()
    for i, (_, size, ptr, _) in enumerate(events):
        if size > 0:
            open_at[ptr] = i
        elif ptr in open_at:
            seen.add(open_at.pop(ptr))
    return seen


def watch_step() -> None:
    original = TrainModel.forward_backward

    def watched(self, *args, **kwargs):
        RECORD["calls"] += 1
        if RECORD["calls"] != WATCHED_CALL:
            return original(self, *args, **kwargs)
        RECORD["state"] = training_state_bytes(self)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            result = original(self, *args, **kwargs)
        RECORD["net_peak"] = largest_net_allocation(prof)
        return result

    TrainModel.forward_backward = watched


def run(argv: list[str]) -> None:
    config = argv[0] if argv and "=" not in argv[0] else None
    overrides = argv[1:] if config else argv
    watch_step()
    train(load_config(*config_and_overrides(config, overrides)))
    out = Path(os.environ["LMFORGE_TENSOR_PEAK_DIR"])
    out.mkdir(parents=True, exist_ok=True)
    state = RECORD["state"]
    record = {"step_peak_bytes": sum(state.values()) + RECORD["net_peak"],
              "state_bytes": state, "net_peak_bytes": RECORD["net_peak"]}
    (out / f"rank{int(os.environ.get('RANK', 0))}.json").write_text(json.dumps(record))
    sys.stdout.flush()
    os._exit(0)  # as `lmforge train` under torchrun: no teardown with gloo threads alive


if __name__ == "__main__":
    run(sys.argv[1:])
