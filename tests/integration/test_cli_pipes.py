"""The command line as a Unix tool (issue 44.5a): a reader that closes its pipe early
(``lmforge estimate --json | head -c 100``, ``lmforge generate ... 2>&1 | head -1``) ends
the command quietly, with no BrokenPipeError traceback, and a file the command writes is
still written. Real processes; the pipe's reader is closed before the command writes, so
every write to it fails, whatever the timing."""
from __future__ import annotations

import json
import os
import subprocess
import sys

# What a shell reports for a command a closed pipe ended (128 + SIGPIPE), as for cat or seq.
READER_GONE = 141


def _run_into_closed_pipe(argv: list[str], both: bool = False, cwd=None):
    """Runs ``lmforge argv`` with stdout (``both``: and stderr) into a pipe whose reader
    is already closed; returns (exit status, stderr text, or '' when it was the pipe)."""
    read, write = os.pipe()
    os.close(read)
    try:
        run = subprocess.run([sys.executable, "-m", "lmforge.cli", *argv], stdout=write,
                             stderr=write if both else subprocess.PIPE, cwd=cwd,
                             timeout=300)
    finally:
        os.close(write)
    return run.returncode, "" if both else run.stderr.decode()


def test_estimate_json_into_a_closed_pipe_ends_quietly(tmp_path):
    code, err = _run_into_closed_pipe(["estimate", "--json"], cwd=tmp_path)
    assert err == "" and code == READER_GONE, (code, err[-2000:])


def test_generate_prompt_into_a_closed_pipe_ends_quietly(bad_input_assets, tmp_path):
    code, err = _run_into_closed_pipe(["generate", "--model", str(bad_input_assets["model"]),
                                       "--prompt", "line 1", "--max-new-tokens", "4",
                                       "--device", "cpu"], cwd=tmp_path)
    assert err == "" and code == READER_GONE, (code, err[-2000:])


def test_generate_with_its_messages_into_a_closed_pipe_still_writes_its_output(
        bad_input_assets, tmp_path):
    """``2>&1 | head -1``: the progress lines have no reader, the completions are the
    product: every record is written and the command succeeds."""
    records = [{"prompt": f"line {i} of a small corpus", "id": i} for i in range(6)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    code, _ = _run_into_closed_pipe(["generate", "--model", str(bad_input_assets["model"]),
                                     "--prompts", "p.jsonl", "--output", "out.jsonl",
                                     "--batch-size", "2", "--max-new-tokens", "4",
                                     "--device", "cpu"], both=True, cwd=tmp_path)
    assert code == 0
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [o["id"] for o in out] == list(range(6))


def test_an_error_with_no_reader_for_it_still_exits_with_its_status(tmp_path):
    """A refusal whose one line cannot be written: status 2 all the same, no traceback."""
    code, _ = _run_into_closed_pipe(["generate", "--model", str(tmp_path / "none"),
                                     "--prompt", "hi"], both=True, cwd=tmp_path)
    assert code == 2
