"""Expert parallelism composed with the other dimensions, on 4 processes (gloo, fp32),
trains the four MoE families as one process does (tests/helpers/moe_training.py, one
4-process launch, the checks of test_moe_layouts):
- ep=2 inside dp_shard=4: each rank holds half of every layer's experts, each of those
  FSDP-sharded over the 2 ranks holding the same experts (efsdp), plain and with LoRA on
  the attention and the experts;
- ep=2 under HSDP (dp_replicate=2 x dp_shard=2): the expert groups replicated;
- ep=2 x tp=2 with sequence parallelism: the attention split over tp, the experts whole
  per tp rank and split over the 2 data-parallel ranks;
- and on 2 processes, ep=2 with every block compiled (train.compile).
Measured: losses within 2.8e-5 relative (DeepSeek-V3 under tp, as without ep), the rest
within 1.8e-6; compiled, losses within 6.2e-7 and grad norms 1.2e-5. About 5 minutes
on 2 cores (4 of them compiling): ``make test-long``."""
import json
from pathlib import Path

import pytest

from helpers import moe_training
from helpers.runs import launch_worker

pytestmark = [pytest.mark.slow, pytest.mark.long]
WORKER = Path(moe_training.__file__)


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe-ep4")
    launch_worker(WORKER, out, 4, timeout=900)
    return json.loads((out / "results-4.json").read_text()), out


@pytest.mark.parametrize("layout", moe_training.layouts(4))
@pytest.mark.parametrize("family", list(moe_training.FAMILIES))
def test_expert_parallel_composes_with_fsdp_hsdp_tp_and_lora_like_one_process(
        launch, family, layout):
    moe_training.check_layout(*launch, family, layout)


@pytest.fixture(scope="module")
def launch_compiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe-ep-compiled")
    launch_worker(WORKER, out, 2, timeout=900,
                  args=(",".join(moe_training.layouts(2, slow=True)),))
    return json.loads((out / "results-2.json").read_text()), out


@pytest.mark.parametrize("layout", moe_training.layouts(2, slow=True))
@pytest.mark.parametrize("family", list(moe_training.FAMILIES))
def test_expert_parallel_compiled_blocks_train_like_one_process(launch_compiled, family,
                                                                 layout):
    moe_training.check_layout(*launch_compiled, family, layout)
