"""The options that take code on purpose say so in their --help, and docs/security.md
names them: an lm-eval task folder (a !function in a task YAML imports and runs the
Python file beside it)."""
from __future__ import annotations

from pathlib import Path

import pytest

from lmforge.cli import main
from lmforge.config import JobConfig
from lmforge.config.keys import describe_keys

SECURITY = Path(__file__).resolve().parents[3] / "docs" / "security.md"


def _help(capsys, *command: str) -> str:
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    return " ".join(capsys.readouterr().out.split())


def test_the_options_that_run_task_code_say_so_in_their_help_and_in_security_md(capsys):
    bench = _help(capsys, "bench-eval")
    include = bench[bench.index("--include-path DIR a folder"):]
    assert "It is code: a !function in a YAML imports and runs the Python file" in include
    keys = " ".join(describe_keys(JobConfig()).split())
    entry = keys[keys.index("eval.harness_include_path"):][:300]
    assert "code: a !function runs its Python file (docs/security.md)" in entry
    doc = SECURITY.read_text()
    section = doc[doc.index("## What runs code you give it"):doc.index("## Residual risks")]
    for name in ("--include-path", "eval.harness_include_path", "!function", "rl.rewards",
                 "--setup"):
        assert name in section, name
