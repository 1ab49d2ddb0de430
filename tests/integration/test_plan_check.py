"""bench/plan_check.py reduced to 2 layouts (the 8-layout table is in docs/plan.md): the
runs go through, the memory estimate is within 10% of the measured tensor peak."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_plan_check_two_layouts(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "plan_check.py"), "--out",
                           str(tmp_path), "--layouts", "2"], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    worst = re.search(r"max \|memory error\| (\d+)%", proc.stdout)
    assert worst, proc.stdout
    assert int(worst.group(1)) <= 10, proc.stdout
