#!/usr/bin/env bash
# The deploy tests' extra (make test-deploy), into .venv: llama-cpp-python, llama.cpp's
# Python binding, and llama.cpp's own command-line tool `llama-completion` (as
# .venv/bin/llama-completion), both built from the one pinned source release. PyPI ships it
# as source only, so the first run compiles llama.cpp for this CPU; the wheel and the tool
# are kept under $LMFORGE_WHEELS (default ~/.cache/lmforge/wheels) and later runs install
# them in seconds. The version is pinned here, as constraints.txt pins the rest. The same
# release's converter (convert_hf_to_gguf.py and the Python it imports) is kept beside the
# tool for the deploy test that compares its GGUF keys with lmforge's; nothing runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
LLAMA_CPP_PYTHON=0.3.36
DISKCACHE=5.6.3
CMAKE=3.31.6  # only where the machine has no cmake
WHEELS=${LMFORGE_WHEELS:-$HOME/.cache/lmforge/wheels}
TOOL=$WHEELS/llama.cpp-$LLAMA_CPP_PYTHON/llama-completion
CONVERTER=$WHEELS/llama.cpp-$LLAMA_CPP_PYTHON/converter
# No network features, no -march=native (a cached build may run on another CPU of the
# same kind), no tests or examples: what the binding and the tool need, nothing else.
COMMON_CMAKE="-DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
bash scripts/setup.sh
PY=.venv/bin/python
PIP=("$PY" -m pip --disable-pip-version-check)
if "$PY" -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$LLAMA_CPP_PYTHON')" \
        >/dev/null 2>&1 && cmp -s "$TOOL" .venv/bin/llama-completion \
        && [ -f "$CONVERTER/convert_hf_to_gguf.py" ]; then
    exit 0
fi
mkdir -p "$WHEELS"
wheel=$(ls "$WHEELS"/llama_cpp_python-$LLAMA_CPP_PYTHON-*.whl 2>/dev/null | head -1 || true)
if [ -z "$wheel" ] || [ ! -x "$TOOL" ] || [ ! -f "$CONVERTER/convert_hf_to_gguf.py" ]; then
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    echo "fetching llama-cpp-python $LLAMA_CPP_PYTHON's sources"
    "${PIP[@]}" download --quiet --no-deps --no-binary :all: \
        "llama-cpp-python==$LLAMA_CPP_PYTHON" -d "$work"
    sdist="$work/llama_cpp_python-$LLAMA_CPP_PYTHON.tar.gz"
fi
if [ -z "$wheel" ]; then
    echo "building llama-cpp-python $LLAMA_CPP_PYTHON (compiles llama.cpp once, minutes)"
    CMAKE_ARGS="$COMMON_CMAKE" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
        "${PIP[@]}" wheel --quiet --no-deps "$sdist" -w "$WHEELS"
    wheel=$(ls "$WHEELS"/llama_cpp_python-$LLAMA_CPP_PYTHON-*.whl | head -1)
fi
if [ ! -x "$TOOL" ]; then
    echo "building llama.cpp's llama-completion from the same sources (minutes)"
    tar -xzf "$sdist" -C "$work"
    if ! command -v cmake >/dev/null; then  # (the wheel's build brings its own cmake)
        "${PIP[@]}" install --quiet "cmake==$CMAKE" && PATH="$PWD/.venv/bin:$PATH"
    fi
    # Static libraries: the one binary runs wherever it is copied. The server (and the
    # new llama-cli, built on it) stays off: llama-completion is the classic CLI.
    # shellcheck disable=SC2086
    cmake -S "$work/llama_cpp_python-$LLAMA_CPP_PYTHON/vendor/llama.cpp" -B "$work/build" \
        -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TOOLS=ON \
        -DLLAMA_BUILD_SERVER=OFF -DLLAMA_OPENSSL=OFF $COMMON_CMAKE >/dev/null
    cmake --build "$work/build" --target llama-completion -j "$(nproc)" >/dev/null
    mkdir -p "$(dirname "$TOOL")"
    cp "$work/build/bin/llama-completion" "$TOOL.partial" && mv "$TOOL.partial" "$TOOL"
fi
if [ ! -f "$CONVERTER/convert_hf_to_gguf.py" ]; then
    src="llama_cpp_python-$LLAMA_CPP_PYTHON/vendor/llama.cpp"
    tar -xzf "$sdist" -C "$work" "$src/convert_hf_to_gguf.py" "$src/conversion" "$src/gguf-py"
    rm -rf "$CONVERTER.partial" && mkdir -p "$CONVERTER.partial"
    cp -r "$work/$src/convert_hf_to_gguf.py" "$work/$src/conversion" "$work/$src/gguf-py" \
        "$CONVERTER.partial/" && rm -rf "$CONVERTER" && mv "$CONVERTER.partial" "$CONVERTER"
fi
"${PIP[@]}" install --quiet --no-deps "$wheel" "diskcache==$DISKCACHE"
cp "$TOOL" .venv/bin/llama-completion
