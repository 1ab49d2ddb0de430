"""``lmforge train`` under TensorMemoryTracker (perf/tracker.py): the peak of live tensor
storage of this process over the whole run, the quantity ``lmforge estimate`` predicts
(peak allocated), written to ``$LMFORGE_TENSOR_PEAK_DIR/rank<R>.json``. On a CPU the
trainer's own ``peak_mem_gib`` is the process's peak RSS (interpreter, libraries,
allocator caches), which the estimate's tensor terms do not model; this worker measures
like with like. Used by bench/plan_check.py as ``torchrun bench/tensor_peak_worker.py
[CONFIG] key=value ...``; the tracker slows every op, so step times come from separate,
untracked runs."""
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from lmforge.cli.common import config_and_overrides  # noqa: E402
from lmforge.config import load_config  # noqa: E402
from lmforge.perf.tracker import TensorMemoryTracker  # noqa: E402
from lmforge.train.loop import train  # noqa: E402
from lmforge.train.model_setup import TrainModel  # noqa: E402

STEP_PEAK = {"calls": 0, "bytes": 0}


def watch_steps(tracker: TensorMemoryTracker) -> None:
    """From the second step on (the first creates the optimizer state), the peak of live
    tensor bytes during each forward-backward, the phase the estimate peaks in."""
    original = TrainModel.forward_backward

    def measured(self, *args, **kwargs):
        STEP_PEAK["calls"] += 1
        if STEP_PEAK["calls"] == 1:
            return original(self, *args, **kwargs)
        tracker.reset_peak()
        STEP_PEAK["start_bytes"] = tracker.live
        try:
            return original(self, *args, **kwargs)
        finally:
            STEP_PEAK["bytes"] = max(STEP_PEAK["bytes"], tracker.peak)

    TrainModel.forward_backward = measured


def run(argv: list[str]) -> None:
    config = argv[0] if argv and "=" not in argv[0] else None
    overrides = argv[1:] if config else argv
    cfg = load_config(*config_and_overrides(config, overrides))
    tracker = TensorMemoryTracker()
    watch_steps(tracker)
    with tracker:
        train(cfg)
    out = Path(os.environ["LMFORGE_TENSOR_PEAK_DIR"])
    out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", 0))
    record = {"run_peak_bytes": tracker.peak, "step_peak_bytes": STEP_PEAK["bytes"],
              "step_start_bytes": STEP_PEAK.get("start_bytes")}
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    sys.stdout.flush()
    os._exit(0)  # as `lmforge train` under torchrun: no teardown with gloo threads alive


if __name__ == "__main__":
    run(sys.argv[1:])
