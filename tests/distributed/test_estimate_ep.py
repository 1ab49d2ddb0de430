"""The memory estimate of expert-parallel layouts against the per-rank peak measured on a
real training step: a tiny Qwen3-MoE (qwen3-moe-debug's shape, vocab 256, seq 64 x
micro-batch 4, fp32) over 2 processes (gloo), parallel.ep=2 parallel.dp_shard=2, full
training and LoRA on the attention and the experts, and over 4, ep=2 below dp_shard=4
(full and LoRA) and ep=2 with HSDP (dp_replicate=2 x dp_shard=2); each rank's peak of live
tensor storage over step 2 (TensorMemoryTracker, FSDP2's unsharded parameters included:
tests/helpers/estimate_ep.py); the estimate of the busiest rank at or above it and within
10% (docs/estimate.md, "Mixture of experts"). One launch per process count, which also
measures FSDP alone (printed, not asserted: docs/estimate.md says where its estimate falls
short)."""
import json
from pathlib import Path

import pytest

from helpers import estimate_ep
from helpers.runs import launch_worker
from lmforge.perf.estimate import estimate_memory
from lmforge.perf.estimate_setup import setup_from_config

pytestmark = pytest.mark.slow
WORKER = Path(estimate_ep.__file__)
TOLERANCE = 0.10


@pytest.fixture(scope="module")
def peaks(tmp_path_factory):
    out = tmp_path_factory.mktemp("estimate_ep")
    launch_worker(WORKER, out, estimate_ep.WORLD, timeout=300)
    return [json.loads((out / f"peaks-{rank}.json").read_text())
            for rank in range(estimate_ep.WORLD)]


@pytest.fixture(scope="module")
def peaks_4(tmp_path_factory):
    out = tmp_path_factory.mktemp("estimate_ep_4")
    launch_worker(WORKER, out, estimate_ep.WORLD_4, timeout=600)
    return [json.loads((out / f"peaks-{rank}.json").read_text())
            for rank in range(estimate_ep.WORLD_4)]


def estimated(layout: str) -> float:
    world = estimate_ep.world_of(layout)
    cfg = estimate_ep.job_config(estimate_ep.BY_WORLD[world][layout], world)
    setup = setup_from_config(cfg, device="cpu", world_size=world, args=estimate_ep.ARGS)
    return estimate_memory(setup).peak_bytes


def compared(peaks: list, layouts) -> dict:
    """layout -> (the busiest rank's measured peak, the estimate), printed in MiB."""
    out = {}
    for name in layouts:
        measured, estimate = max(p[name] for p in peaks), estimated(name)
        print(f"{name}: measured {measured / 2**20:.3f} MiB, estimated "
              f"{estimate / 2**20:.3f} MiB ({(estimate - measured) / measured:+.1%})")
        out[name] = (measured, estimate)
    return out


def test_ep_estimate_within_10_percent_of_the_busiest_rank(peaks):
    measured = max(p["ep2_dp2"] for p in peaks)
    estimate = estimated("ep2_dp2")
    print(f"ep2_dp2: measured {measured / 2**20:.3f} MiB, estimated "
          f"{estimate / 2**20:.3f} MiB; dp2: measured "
          f"{max(p['dp2'] for p in peaks) / 2**20:.3f}, estimated "
          f"{estimated('dp2') / 2**20:.3f}")
    assert measured <= estimate <= (1 + TOLERANCE) * measured, (measured, estimate)


def test_lora_on_the_experts_under_ep_is_estimated_at_or_above_its_peak(peaks):
    results = compared(peaks, ["ep2_dp2_lora", "dp2_lora"])
    measured, estimate = results["ep2_dp2_lora"]
    assert measured <= estimate <= (1 + TOLERANCE) * measured


@pytest.mark.long  # (4 processes: make test-long; the LoRA row's margin is 1.4%, and a
# rank's peak moved by up to 0.19 MiB between runs on a loaded machine)
@pytest.mark.parametrize("layout", ["ep2_dp4", "ep2_dp2x2", "ep2_dp4_lora"])
def test_ep_below_dp_shard_and_with_hsdp_estimated_at_or_above_its_peak(peaks_4, layout):
    measured, estimate = compared(peaks_4, [layout, "dp4"])[layout]
    assert measured <= estimate <= (1 + TOLERANCE) * measured
