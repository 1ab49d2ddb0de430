# The two commands of the README: `make demo` and `make test`.
.PHONY: setup demo test test-fast test-long test-deploy test-cluster gpu-check

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/lmforge train train.overwrite=true  # each demo starts over in runs/demo

# A line per test file with the share done and the time taken so far (-v cancels the
# -q of pyproject's addopts), then the ten slowest tests. The few runs marked long (minutes
# each) wait for test-long, and the llama.cpp runs (deploy) for test-deploy, which CI runs
# too: make test stays within 15 minutes on a quiet 2-core machine.
test: setup
	.venv/bin/python -m pytest -v --durations=10 -m "not long and not cluster and not deploy" tests

test-long: setup
	.venv/bin/python -m pytest -v --durations=10 -m long tests

# What to run while working: everything but the end-to-end runs marked slow.
test-fast: setup
	.venv/bin/python -m pytest -m "not slow" tests

# SLURM for real (tests/cluster): a one-host cluster from the OS packages (slurm-wlm, munge;
# installed with apt-get when missing, as root), jobs submitted by lmforge launch slurm.
test-cluster: setup
	.venv/bin/python -m pytest -v -m cluster tests/cluster

# GGUF exports run in llama.cpp itself (tests/deploy): installs llama-cpp-python first
# (PyPI ships source only: llama.cpp compiles once, and the wheel is cached).
test-deploy: setup
	bash scripts/setup_deploy.sh
	.venv/bin/python -m pytest -v -m deploy tests/deploy

# On a CUDA machine: the GPU tests, then every training path for a few steps and the
# side-by-side benches (bench/gpu_check.py; docs/benchmarks.md says how to run it on a lent
# GPU). It uses that machine's Python as it is: GPU images have no package index.
PYTHON ?= python3
GPU_CHECK_OUT ?= runs/gpu-check
GPU_CHECK_ARGS ?= --budget-s 420
SRC_PATH = PYTHONPATH=src$${PYTHONPATH:+:$$PYTHONPATH}

gpu-check:
	-$(SRC_PATH) $(PYTHON) -m pytest -m gpu tests/gpu -p no:cacheprovider
	$(SRC_PATH) PYTHONUNBUFFERED=1 $(PYTHON) bench/gpu_check.py --out $(GPU_CHECK_OUT) $(GPU_CHECK_ARGS)
