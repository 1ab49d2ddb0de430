"""Makes ``src/`` importable when the package is not installed (e.g. PYTHONPATH-less runs),
and holds the fixtures every test directory shares."""
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

# tests/helpers/ holds shared helpers (importable as `helpers.*`).
TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))


@pytest.fixture
def tiny_llama():
    """The suite's tiny random Llama (tests/helpers/tiny_models.py), fp32 on the CPU."""
    from helpers.tiny_models import tiny_llama as build  # importable only after the path

    return build()


@pytest.fixture(scope="session", autouse=True)
def data_cache(tmp_path_factory):
    """The data caches (lmforge.data.cache) of the whole session go to a temporary
    directory, never to ~/.cache/lmforge. Session-wide, so module fixtures that train
    (and subprocesses such as torchrun ranks, which inherit it) use it too."""
    root = tmp_path_factory.mktemp("lmforge-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LMFORGE_CACHE", str(root))
        yield root
