"""Makes ``src/`` importable when the package is not installed (e.g. PYTHONPATH-less runs)."""
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

# tests/helpers/ holds shared helpers (importable as `helpers.*`).
TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))
