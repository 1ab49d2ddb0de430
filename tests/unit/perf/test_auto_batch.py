"""data.micro_batch_size=auto (perf/auto_batch.py): the largest micro-batch whose estimate
fits a device's memory less the margin, the global batch kept by accumulation; what a run
prints and records; lmforge plan on one GPU proposing the same. The device memory is a
fake budget (monkeypatch), so all of it runs on the CPU."""
import dataclasses
import json

import pytest
import yaml

from lmforge.cli import main
from lmforge.config import load_config
from lmforge.perf import auto_batch as A
from lmforge.perf.budget import Budget
from lmforge.perf.estimate import GiB, estimate_memory
from lmforge.perf.estimate_setup import setup_from_config
from lmforge.perf.layout_search import MEMORY_MARGIN
from lmforge.perf.timing import DEVICES

TINY = ["model.preset=tiny", "data.seq_len=256", "train.device=cpu"]  # activations grow


def estimate(overrides, b, device="cpu") -> float:
    cfg = load_config(None, [*overrides, f"data.micro_batch_size={b}"])
    return estimate_memory(setup_from_config(cfg, device=device)).total_bytes


def budget_between(overrides, low: int, high: int) -> Budget:
    """A device whose usable memory (less the margin) lies between the estimates of
    micro-batches ``low`` and ``high``."""
    usable = (estimate(overrides, low) + estimate(overrides, high)) / 2
    return Budget(usable / (1 - MEMORY_MARGIN), "a fake device")


@pytest.mark.parametrize("target", [1, 5, 13])
def test_auto_picks_the_largest_micro_batch_whose_estimate_fits_less_the_margin(target):
    budget = budget_between(TINY, target, target + 1)
    cfg = load_config(None, [*TINY, "data.micro_batch_size=auto"])
    auto = A.pick_micro_batch(cfg, 1, budget)
    usable = budget.bytes * (1 - MEMORY_MARGIN)
    assert auto.micro_batch == target
    assert estimate(TINY, target) <= usable < estimate(TINY, target + 1)
    assert auto.next_size == target + 1 and auto.accumulation == 1


def test_auto_keeps_the_global_batch_with_the_largest_divisor_that_fits():
    budget = budget_between(TINY, 5, 6)  # 5 fits, 6 does not; 12's divisors: 1 2 3 4 6 12
    cfg = load_config(None, [*TINY, "data.micro_batch_size=auto", "data.global_batch_size=12"])
    auto = A.pick_micro_batch(cfg, 1, budget)
    assert (auto.micro_batch, auto.accumulation, auto.share) == (4, 3, 12)
    assert auto.larger_fits and auto.next_size == 6
    line = A.describe(auto)
    assert line.startswith("data.micro_batch_size=auto: 4 (")
    assert "a larger one fits but does not divide the 12 sequences each rank runs" in line
    assert line.endswith("global batch 12 (data.global_batch_size) = 4 x 3 accumulated x "
                         "1 rank")
    assert "\n" not in line


def test_auto_without_a_global_batch_says_the_global_batch_follows_the_pick():
    auto = A.pick_micro_batch(load_config(None, [*TINY, "data.micro_batch_size=auto"]), 1,
                              budget_between(TINY, 3, 4))
    assert A.describe(auto).endswith("global batch 3 = 3 x 1 rank (data.global_batch_size "
                                     "unset: one micro-batch per rank)")


def test_auto_with_in_backward_takes_the_whole_share_or_nothing():
    low = [*TINY, "train.param_dtype=bf16", "optim.name=adamw_bf16", "optim.in_backward=true",
           "optim.grad_clip=0"]
    cfg = load_config(None, [*low, "data.micro_batch_size=auto", "data.global_batch_size=4"])
    assert A.pick_micro_batch(cfg, 1, budget_between(low, 4, 5)).micro_batch == 4
    with pytest.raises(A.ConfigError, match=r"^data\.micro_batch_size: auto found no "
                       r"micro-batch that fits: 4 sequence\(s\) need about"):
        A.pick_micro_batch(cfg, 1, budget_between(low, 2, 3))


def test_largest_fitting_is_a_binary_search_over_ascending_candidates():
    asked = []

    def fits(b):
        asked.append(b)
        return b <= 700
    assert A.largest_fitting(list(range(1, 1025)), fits) == 700
    assert len(asked) <= 11
    assert A.largest_fitting([1, 2, 4], lambda b: False) is None
    assert A.largest_fitting([1, 2, 4], lambda b: True) == 4


def test_a_run_with_auto_prints_records_and_keeps_the_global_batch(tmp_path, monkeypatch,
                                                                     capsys):
    """A real CPU run on a fake 'GPU' budget: 4 of the divisors of 8 fits, so 2 micro-batches
    of 4 are accumulated each step; config.yaml and summary.json hold 4."""
    run = [*TINY, "data.global_batch_size=8"]
    budget = budget_between(TINY, 4, 5)  # (the memory of a micro-batch: no global batch)
    monkeypatch.setattr(A, "auto_budget", lambda device, local_rank=0: budget)
    code = main(["train", *run, "data.micro_batch_size=auto", "train.max_steps=2",
                 "train.log_every=1", "optim.warmup_steps=0", "train.sample_tokens=0",
                 "train.save=false", "metrics.tracker=none", "data.eval_fraction=0",
                 f"train.output_dir={tmp_path / 'run'}"])
    out = capsys.readouterr().out
    assert code == 0
    lines = [line for line in out.splitlines() if line.startswith("data.micro_batch_size=auto")]
    assert len(lines) == 1 and lines[0].startswith("data.micro_batch_size=auto: 4 (")
    assert "= 4 x 2 accumulated x 1 rank" in lines[0]
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["data"]["micro_batch_size"] == 4 and saved["data"]["global_batch_size"] == 8
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["micro_batch_size"] == 4
    records = [json.loads(line) for line in
               (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["consumed_samples"] for r in records] == [8, 16]  # the global batch asked for


def test_print_config_shows_the_sized_number(monkeypatch, capsys):
    monkeypatch.setattr(A, "auto_budget",
                        lambda device, local_rank=0: budget_between(TINY, 6, 7))
    assert main(["train", "--print-config", *TINY, "data.micro_batch_size=auto"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["data"]["micro_batch_size"] == 6


def test_plan_on_one_gpu_proposes_what_the_run_would_pick():
    gpu = ["model.preset=small", "model.vocab_size=32000", "data.seq_len=2048",
           "train.device=cuda"]
    h100 = DEVICES["h100"]
    cfg = load_config(None, [*gpu, "data.micro_batch_size=auto"])
    picked = A.pick_micro_batch(cfg, 1, Budget(h100.memory_gib * GiB, "h100"),
                                device="cuda").micro_batch
    result = A.plan_auto(cfg, 1, 8, h100)
    own = [c for c in result.candidates
           if c.keys["train.activation_checkpointing"] == "none"
           and not c.keys["train.loss_chunk_tokens"]]
    assert picked > 1 and [c.setup.micro_batch for c in own] == [picked]
    # each layout at its own largest: full checkpointing fits more
    full = [c for c in result.candidates if c.keys["train.activation_checkpointing"] == "full"
            and not c.keys["train.loss_chunk_tokens"]]
    assert full[0].setup.micro_batch > picked


def test_plan_auto_keeps_a_global_batch_and_fits_the_budget():
    small = ["model.preset=small", "model.vocab_size=32000", "data.seq_len=512",
             "train.device=cuda", "data.micro_batch_size=auto", "data.global_batch_size=16"]
    device = dataclasses.replace(DEVICES["h100"], memory_gib=4.0)
    result = A.plan_auto(load_config(None, small), 2, 2, device)
    assert result.candidates
    for c in result.candidates:
        dp = c.setup.layout.dp
        assert c.peak_gib <= 4.0 * (1 - MEMORY_MARGIN)
        assert c.setup.batch.per_step == 16 and (16 // dp) % c.keys["data.micro_batch_size"] == 0
