#!/usr/bin/env bash
# Creates .venv and installs lmforge with its test extras at the versions constraints.txt
# pins (the set CI was tested with; scripts/update_constraints.py regenerates it), so a
# fresh machine gets that set whatever was published since. A machine that already has
# PyTorch (a GPU image, say) keeps its own build; otherwise the pinned CPU wheel goes in.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    # System site-packages stay visible so a preinstalled torch is reused.
    "$PYTHON" -m venv --system-site-packages .venv
fi
PY=.venv/bin/python

if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    # Pinned: an unpinned `torch` would pull several GB of CUDA packages.
    "$PY" -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
fi
# Compare the install stamp with what it installed from, so a re-run costs nothing.
stamp=.venv/.lmforge-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints.txt -nt "$stamp" ]; then
    "$PY" -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[test]"
    touch "$stamp"
fi
