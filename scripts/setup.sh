#!/usr/bin/env bash
# Creates .venv and installs lmforge with its test extras at the versions constraints.txt
# pins (the set CI was tested with; scripts/update_constraints.py regenerates it), so a
# fresh machine gets that set whatever was published since. The venv sees none of the
# host's packages (so pip and pytest see only the pinned set), except a CUDA build of
# PyTorch (a GPU image's, which has no index to fetch another): scripts/host_torch.py lends
# it. Any other machine gets the pinned CPU wheel.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ -f .venv/pyvenv.cfg ] && grep -qiE '^include-system-site-packages *= *true' .venv/pyvenv.cfg; then
    # Made by an earlier setup.sh that let the venv see every host package.
    echo "setup: .venv sees the host's packages; making it anew with the pinned set only"
    rm -rf .venv
fi
if [ ! -x .venv/bin/python ]; then
    rm -rf .venv  # a half-made one
    "$PYTHON" -m venv .venv
    "$PYTHON" scripts/host_torch.py .venv
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
