"""The hybrid stacks (Gated DeltaNet and gated full-attention layers: Qwen3.5, Qwen3-Next,
Qwen3.5-MoE) train under FSDP2 (dp_shard=2), plain, with LoRA on every linear (the
DeltaNet's projections among them) and over packed documents, as one process does: the
same per-step loss and gradient norm (1e-5 relative) and final weights (1e-4), 3 steps,
fp32 on the CPU with gloo, through the trainer's own step
(tests/helpers/hybrid_training.py, one 2-process launch)."""
import json
from pathlib import Path

import pytest

from helpers import hybrid_training
from helpers.runs import launch_worker

pytestmark = [pytest.mark.slow, pytest.mark.long]  # make test-long (one 2-process launch, 23 s)
WORKER = Path(hybrid_training.__file__)


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    out = tmp_path_factory.mktemp("hybrid")
    launch_worker(WORKER, out, 2)
    return json.loads((out / "results-2.json").read_text()), out


@pytest.mark.parametrize("layout", list(hybrid_training.LAYOUTS))
@pytest.mark.parametrize("family", list(hybrid_training.FAMILIES))
def test_hybrid_family_trains_in_layout_like_one_process(launch, family, layout):
    hybrid_training.check_layout(*launch, family, layout)
