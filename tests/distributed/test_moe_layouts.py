"""The mixture-of-experts families train under FSDP2 (dp_shard=2), plain and with LoRA on
the attention and the experts, and under tensor parallelism (tp=2, with and without
sequence parallelism: the attention split, the experts whole on each rank), and with
expert parallelism over the FSDP ranks (parallel.ep = dp_shard = 2: half of each layer's
experts per rank, tokens sent by all-to-all; plain and with LoRA on the attention and the
experts, the adapters split with the experts; recomputing each block in backward) as
one process does: the same per-step loss (1e-5 relative, the load-balancing loss in every step),
gradient norm (1e-5; tp 5e-5) and final weights (1e-4; tp 1e-3, a tenth of the lr), fp32 on the CPU with
gloo, through the trainer's own step (tests/helpers/moe_training.py, one 2-process
launch)."""
import json
from pathlib import Path

import pytest

from helpers import moe_training
from helpers.runs import launch_worker

pytestmark = pytest.mark.slow
WORKER = Path(moe_training.__file__)


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe")
    launch_worker(WORKER, out, 2, args=(",".join(moe_training.layouts(2)),))
    return json.loads((out / "results-2.json").read_text()), out


@pytest.mark.parametrize("layout", moe_training.layouts(2))
@pytest.mark.parametrize("family", list(moe_training.FAMILIES))
def test_moe_family_trains_in_layout_like_one_process(launch, family, layout):
    moe_training.check_layout(*launch, family, layout)
