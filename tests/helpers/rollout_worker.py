"""`lmforge` that records every rollout's decode on each rank (tests only): each call of
the GRPO objective's ``generate`` appends one line to LMFORGE_TEST_ROLLOUTS/rank-R.jsonl:
its rows' completion lengths and finish reasons, how many forwards the model ran (the
prefill and each one-token step), and in them how many MoE layers' experts dispatched
tokens to their ranks (``ExpertParallelMixin``) and how many ran the CPU decode's packed
products (``models.packed_linear``: never expert-parallel ones). Under data (or expert) parallelism every rank must
run as many forwards as the rank that decodes longest, its own rows done or not.

``torchrun ... rollout_worker.py train [OVERRIDES]``, as ``lmforge train``."""
import json
import os
import sys
from pathlib import Path

import lmforge.train.grpo as grpo
from lmforge.models.moe import GroupedExperts
from lmforge.parallel.expert import ExpertParallelMixin

_generate = grpo.generate


def recorded_generate(model, prompts, *args, **kwargs):
    forwards, experts = [0], {}

    def count(*_):
        forwards[0] += 1
        stacks = [m for m in model.modules() if isinstance(m, GroupedExperts)]
        experts["dispatching"] = sum(isinstance(m, ExpertParallelMixin) for m in stacks)
        experts["packed"] = sum("product" in m.__dict__ for m in stacks)

    handle = model.register_forward_pre_hook(count)
    try:
        rows = _generate(model, prompts, *args, **kwargs)
    finally:
        handle.remove()
    out = Path(os.environ["LMFORGE_TEST_ROLLOUTS"])
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"rank-{os.environ.get('RANK', '0')}.jsonl", "a") as f:
        f.write(json.dumps({"lengths": [len(c.ids) for c in rows],
                            "reasons": [c.finish_reason for c in rows],
                            "forwards": forwards[0], **experts}) + "\n")
    return rows


grpo.generate = recorded_generate

if __name__ == "__main__":
    from lmforge.cli import main

    sys.exit(main(sys.argv[1:]))
