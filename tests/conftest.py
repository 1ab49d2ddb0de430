"""Makes ``src/`` importable when the package is not installed (e.g. PYTHONPATH-less runs),
and holds the fixtures every test directory shares."""
import sys
import time
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


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    """The progress at the end of each line also says how long the run has taken
    ("[ 42% 3:05]"), so a slow machine does not look hung (``make test`` prints a line
    per test file)."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    progress = getattr(reporter, "_get_progress_information_message", None)
    if progress is None:  # another pytest: keep its own progress
        return
    start = time.monotonic()

    def with_elapsed() -> str:
        minutes, seconds = divmod(int(time.monotonic() - start), 60)
        return f"{progress().rstrip(']')} {minutes}:{seconds:02d}]"

    reporter._get_progress_information_message = with_elapsed


@pytest.fixture(scope="session", autouse=True)
def data_cache(tmp_path_factory):
    """The data caches (lmforge.data.cache) of the whole session go to a temporary
    directory, never to ~/.cache/lmforge. Session-wide, so module fixtures that train
    (and subprocesses such as torchrun ranks, which inherit it) use it too."""
    root = tmp_path_factory.mktemp("lmforge-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LMFORGE_CACHE", str(root))
        yield root
