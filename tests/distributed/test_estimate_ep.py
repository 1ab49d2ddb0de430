"""The memory estimate of expert-parallel layouts against the per-rank peak measured on a
real training step: a tiny Qwen3-MoE (qwen3-moe-debug's shape, vocab 256, seq 64 x
micro-batch 4, fp32) over 2 processes (gloo), parallel.ep=2 parallel.dp_shard=2, full
training and LoRA on the attention and the experts, and over 4, ep=2 below dp_shard=4
(full and LoRA) and ep=2 with HSDP (dp_replicate=2 x dp_shard=2); each rank's peak of live
tensor storage over step 2 (TensorMemoryTracker, FSDP2's unsharded parameters included:
tests/helpers/estimate_ep.py), and the routed rows each rank received as a multiple of its
balanced share. The busiest rank's peak against the estimate at the busiest measured
share, at or above it and within 10% (the memory model itself), and against the default
estimate, whose routing allowance (``moe_walk.EP_IMBALANCE``, 1.25) must keep it at or
above the peak (docs/estimate.md, "Mixture of experts"). One launch per process count,
which also measures FSDP alone (printed, not asserted: docs/estimate.md says where its
estimate falls short)."""
import json
from pathlib import Path

import pytest

from helpers import estimate_ep
from helpers.runs import launch_worker
from lmforge.perf import moe_walk
from lmforge.perf.estimate import estimate_memory
from lmforge.perf.estimate_setup import setup_from_config

pytestmark = pytest.mark.slow
WORKER = Path(estimate_ep.__file__)
TOLERANCE = 0.10


def launched(out: Path, world: int, timeout: int) -> list[dict]:
    launch_worker(WORKER, out, world, timeout=timeout)
    return [json.loads((out / f"peaks-{rank}.json").read_text()) for rank in range(world)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return launched(tmp_path_factory.mktemp("estimate_ep"), estimate_ep.WORLD, 300)


@pytest.fixture(scope="module")
def runs_4(tmp_path_factory):
    return launched(tmp_path_factory.mktemp("estimate_ep_4"), estimate_ep.WORLD_4, 600)


def estimated(layout: str, share: float | None = None) -> float:
    """The estimate of ``layout``'s busiest rank; with ``share``, at that routing share in
    place of the default allowance (``arrived_share`` still caps it by the routing's
    bound)."""
    world = estimate_ep.world_of(layout)
    cfg = estimate_ep.job_config(estimate_ep.BY_WORLD[world][layout], world)
    setup = setup_from_config(cfg, device="cpu", world_size=world, args=estimate_ep.ARGS)
    with pytest.MonkeyPatch.context() as patch:
        if share is not None:
            patch.setattr(moe_walk, "EP_IMBALANCE", share)
        return estimate_memory(setup).peak_bytes


def mib(n: float) -> str:
    return f"{n / 2**20:.3f} MiB"


# The 4-process rows' peaks move between runs with the same routing (measured: up to
# 0.19 MiB before the tracker's fix; ep2_dp4_lora 6.057 and then 6.189 MiB after it, on a
# quiet machine), the threads of 4 processes on 2 cores ordering frees and allocations
# differently: the estimate at the measured share may fall that far under a run's peak.
RUN_TO_RUN_4 = 0.2 * 2**20


def check_ep_row(runs: list, layout: str, fsdp_alone: str, noise: float = 0.0) -> None:
    """The busiest rank's peak of ``layout`` within the estimate at the busiest measured
    share (+0 .. +10%, less ``noise`` bytes below), and at or under the default estimate;
    ``fsdp_alone`` printed."""
    measured = max(r["peaks"][layout] for r in runs)
    shares = [share for r in runs for share in r["shares"][layout]]
    assert shares, f"{layout}: no expert-parallel dispatch recorded"
    share = max(shares)
    at_share, default = estimated(layout, share), estimated(layout)
    alone, alone_estimate = max(r["peaks"][fsdp_alone] for r in runs), estimated(fsdp_alone)
    print(f"{layout}: measured {mib(measured)}; busiest share {share:.3f} "
          f"(per rank and MoE forward: {', '.join(f'{s:.3f}' for s in shares)}): "
          f"estimated {mib(at_share)} "
          f"({(at_share - measured) / measured:+.1%}); at {moe_walk.EP_IMBALANCE}: "
          f"{mib(default)} ({(default - measured) / measured:+.1%}); {fsdp_alone}: "
          f"measured {mib(alone)}, estimated {mib(alone_estimate)} "
          f"({(alone_estimate - alone) / alone:+.1%})")
    assert measured - noise <= at_share <= (1 + TOLERANCE) * measured, (measured, at_share,
                                                                        share)
    assert measured <= default, (measured, default)


def test_ep_estimate_within_10_percent_of_the_busiest_rank(runs):
    check_ep_row(runs, "ep2_dp2", "dp2")


def test_lora_on_the_experts_under_ep_is_estimated_at_or_above_its_peak(runs):
    check_ep_row(runs, "ep2_dp2_lora", "dp2_lora")


@pytest.mark.long  # (4 processes: make test-long)
@pytest.mark.parametrize("layout", ["ep2_dp4", "ep2_dp2x2", "ep2_dp4_lora"])
def test_ep_below_dp_shard_and_with_hsdp_estimated_at_or_above_its_peak(runs_4, layout):
    check_ep_row(runs_4, layout, "dp4", noise=RUN_TO_RUN_4)
