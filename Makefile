# The two commands of the README: `make demo` and `make test`.
.PHONY: setup demo test

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/lmforge train

test: setup
	.venv/bin/python -m pytest tests
