"""The calibration fit, its file, and the CPU device's need for it."""
import subprocess
import sys

import pytest

from lmforge.perf.calibrate import (fit_scales, fitted_device, load_calibration,
                                    save_calibration, spearman, step_seconds)
from lmforge.perf.timing import DEVICES


def test_fit_recovers_known_scales():
    terms = [(1.0, 0.5), (2.0, 0.1), (0.5, 2.0), (3.0, 1.0)]
    measured = [2 * x + 3 * y for x, y in terms]
    a, b = fit_scales(terms, measured)
    assert a == pytest.approx(2) and b == pytest.approx(3)


def test_fit_without_communication_keeps_the_links():
    a, b = fit_scales([(1.0, 0.0), (2.0, 0.0)], [3.0, 6.0])
    assert (a, b) == (pytest.approx(3), 1.0)


def test_fitted_device_scales_efficiency_and_bandwidth(tmp_path):
    dev = fitted_device(DEVICES["h100"], 2.0, 4.0)
    assert dev.efficiency == pytest.approx(0.2)
    assert dev.intra.gb_per_s == pytest.approx(112.5)
    assert dev.intra.latency_us == DEVICES["h100"].intra.latency_us
    save_calibration(tmp_path / "c.json", "h100", dev, [])
    name, back = load_calibration(tmp_path / "c.json")
    assert name == "h100" and back.peak_flops == pytest.approx(dev.peak_flops)
    assert back.efficiency == pytest.approx(dev.efficiency) and back.intra == dev.intra


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
