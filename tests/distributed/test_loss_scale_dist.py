"""fp16 loss scaling across processes: an overflow on one rank skips the step on all."""
import re

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from helpers.runs import read_metrics, run_lmforge, tiny_overrides

pytestmark = pytest.mark.slow


def _trained_state(ckpt, scratch) -> dict:
    """A checkpoint's weights and optimizer state (without the LR, which moves on)."""
    dcp_to_torch_save(ckpt, scratch)
    saved = torch.load(scratch, weights_only=True)
    return {**{f"model.{k}": v for k, v in saved["model"].items()},
            **{k: v for k, v in saved["optimizer"].items() if k.startswith("state.")}}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# FSDP2: the ranks hold shards of the same parameters. pp: they hold different stages,
# whose gradients no DTensor reduction connects (GradScaler alone would part them).
@pytest.mark.parametrize("layout", ["parallel.dp_shard=2", "parallel.pp=2"],
                         ids=["fsdp_dp2", "pp2"])
def test_an_overflow_on_one_rank_skips_the_step_on_both(tiny_corpus, tmp_path, layout):
    out = tmp_path / "run"
    proc = run_lmforge(out, tiny_overrides(tiny_corpus, 4) + [
        layout, "train.dtype=fp16", "train.checkpoint_every=1", "train.keep_last=0",
        "train.save=false"], nproc=2, fault="inf_grad:1:3")
    ckpts = out / "checkpoints"
    states = {s: _trained_state(ckpts / f"step-000000{s}", tmp_path / f"{s}.pt")
              for s in (2, 3, 4)}
    assert _same(states[2], states[3])  # step 3 changed nothing, on either rank
    assert not _same(states[3], states[4])  # step 4 trained again
    scales = re.findall(r"rank (\d): step (\d): loss scale (\d+)", proc.stdout)
    by_rank = {r: [int(s) for rank, _, s in sorted(scales, key=lambda x: int(x[1]))
                   if rank == r] for r in "01"}
    assert by_rank["0"] == by_rank["1"] == [2**16, 2**16, 2**15, 2**15]
    records = read_metrics(out)
    assert [r["skipped_steps"] for r in records] == [0, 0, 1, 1]
    assert "step 3: fp16 gradients overflowed at loss scale 65536" in proc.stderr
