"""The calibration fit, its file, and the CPU device's need for it."""
import subprocess
import sys

import pytest

from lmforge.cli.common import config_and_overrides
from lmforge.config import load_config
from lmforge.perf.calibrate import (fit_columns, fit_constants, fitted_device,
                                    load_calibration, prior_constants, save_calibration,
                                    spearman, step_seconds)
from lmforge.perf.layout_search import evaluate
from lmforge.perf.timing import DEVICES


def test_fit_recovers_known_constants():
    columns = [(1.0, 0.5, 0.1, 3.0), (2.0, 0.1, 0.4, 1.0), (0.5, 2.0, 0.2, 2.0),
               (3.0, 1.0, 0.3, 5.0), (1.5, 0.2, 1.0, 0.5)]
    truth = (2.0, 3.0, 0.5, 4.0)
    measured = [sum(k * c for k, c in zip(truth, row)) for row in columns]
    assert fit_constants(columns, measured, (1.0, 1.0, 1.0, 0.0)) == pytest.approx(truth)


def test_a_constant_the_candidates_cannot_resolve_keeps_its_prior():
    columns = [(1.0, 0.0, 0.0, 1.0), (2.0, 0.0, 0.0, 1.0), (3.0, 0.0, 0.0, 1.0)]
    measured = [3.0 * x + 0.5 for x, *_ in columns]
    a, b, d, c = fit_constants(columns, measured, (1.0, 1.0, 1.0, 0.0))
    assert (a, b, d, c) == (pytest.approx(3.0), 1.0, 1.0, pytest.approx(0.5))


def test_fitted_device_scales_efficiency_links_and_overhead(tmp_path):
    dev = fitted_device(DEVICES["h100"], (2.0, 4.0, 3.0, 7.0))
    assert dev.efficiency == pytest.approx(0.2)
    assert dev.intra.gb_per_s == pytest.approx(112.5)
    assert dev.intra.latency_us == pytest.approx(3 * DEVICES["h100"].intra.latency_us)
    assert dev.block_pass_us == 7.0
    save_calibration(tmp_path / "c.json", "h100", dev, [])
    name, back = load_calibration(tmp_path / "c.json")
    assert name == "h100" and back.peak_flops == pytest.approx(dev.peak_flops)
    assert back.efficiency == pytest.approx(dev.efficiency) and back.intra == dev.intra
    assert back.block_pass_us == 7.0


def test_fit_columns_add_up_to_the_prediction():
    """At the prior constants, a X + b Y + d L + c P is the uncalibrated step time (the
    latency and bandwidth parts of a collective add up)."""
    cfg = load_config(*config_and_overrides(None, ["data.seq_len=64",
                                                   "data.global_batch_size=8"]))
    cand = evaluate(cfg, {"parallel.tp": 2, "parallel.dp_shard": 1,
                          "data.micro_batch_size": 4}, 2, 8, DEVICES["cpu"])
    columns = fit_columns(cand.setup, DEVICES["cpu"], 8)
    prior = prior_constants(DEVICES["cpu"])
    assert sum(k * c for k, c in zip(prior, columns)) == pytest.approx(cand.time.total)
    assert all(c > 0 for c in columns)


def test_step_seconds_skips_the_first_step():
    records = [{"step": 1, "tokens": 100, "tokens_per_s": 10},
               {"step": 2, "tokens": 200, "tokens_per_s": 100},
               {"step": 3, "tokens": 300, "tokens_per_s": 50}]
    assert step_seconds(records) == pytest.approx(1.5)


def test_spearman():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1)


def test_plan_on_cpu_requires_a_calibration():
    proc = subprocess.run([sys.executable, "-m", "lmforge.cli", "plan", "--gpus", "2",
                           "--device", "cpu"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "--calibrate" in proc.stderr and "--calibration" in proc.stderr
