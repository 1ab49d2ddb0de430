#!/usr/bin/env bash
# The deploy tests' extra (make test-deploy): llama-cpp-python, llama.cpp's Python binding,
# into .venv. PyPI ships it as source only, so the first run compiles llama.cpp for this
# CPU; the wheel is kept under $LMFORGE_WHEELS (default ~/.cache/lmforge/wheels) and later
# runs install it in seconds. The version is pinned here, as constraints.txt pins the rest.
set -euo pipefail
cd "$(dirname "$0")/.."
LLAMA_CPP_PYTHON=0.3.36
DISKCACHE=5.6.3
WHEELS=${LMFORGE_WHEELS:-$HOME/.cache/lmforge/wheels}
bash scripts/setup.sh
PY=.venv/bin/python
if "$PY" -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$LLAMA_CPP_PYTHON')" \
        >/dev/null 2>&1; then
    exit 0
fi
mkdir -p "$WHEELS"
wheel=$(ls "$WHEELS"/llama_cpp_python-$LLAMA_CPP_PYTHON-*.whl 2>/dev/null | head -1 || true)
if [ -z "$wheel" ]; then
    echo "building llama-cpp-python $LLAMA_CPP_PYTHON (compiles llama.cpp once, minutes)"
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" \
    CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
        "$PY" -m pip wheel --quiet --disable-pip-version-check --no-deps \
        "llama-cpp-python==$LLAMA_CPP_PYTHON" -w "$WHEELS"
    wheel=$(ls "$WHEELS"/llama_cpp_python-$LLAMA_CPP_PYTHON-*.whl | head -1)
fi
"$PY" -m pip install --quiet --disable-pip-version-check --no-deps "$wheel" \
    "diskcache==$DISKCACHE"
