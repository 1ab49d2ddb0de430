"""Expert parallelism (``parallel/expert.py``) over 2 processes (gloo, fp32, CPU), each
feeding different tokens to a tiny MoE block (dim 32, 8 experts, top-2, ffn 16; plain
SwiGLU, and gpt-oss's biased router, biased experts and clamped SwiGLU) whose experts are
split 4 + 4: output and input gradient as one process's on the rank's tokens, the
experts' gathered gradients as one process's summed over both ranks' tokens (1e-5); a
rank whose tokens choose none of its experts (and which receives nothing); an ep that
does not divide the experts refused naming ``parallel.ep``. One launch
(tests/helpers/expert_parallel.py)."""
import json
from pathlib import Path

import pytest

from helpers import expert_parallel
from helpers.runs import launch_worker

pytestmark = pytest.mark.slow
WORKER = Path(expert_parallel.__file__)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("ep")
    launch_worker(WORKER, out, 2, timeout=120)
    return [json.loads((out / f"results-{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("case", list(expert_parallel.CASES))
def test_expert_parallel_matches_one_process(results, case, rank):
    assert results[rank].get(case) == "ok", f"rank {rank}, {case}:\n{results[rank].get(case)}"
