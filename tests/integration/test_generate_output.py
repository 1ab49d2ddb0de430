"""``lmforge generate --prompts``'s output while it runs (issue 44.4): the records are
written to --output, in the input's order, as each group of batches finishes, so an
interrupted or killed run keeps every record it finished, each a complete line."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from lmforge.cli import main

TEXTS = [f"line {i} of a small corpus" for i in range(40)]


def _prompts(path, count: int) -> list[dict]:
    records = [{"prompt": TEXTS[i % len(TEXTS)], "id": i} for i in range(count)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def _assert_a_finished_prefix(out_path, records: list[dict]) -> list[dict]:
    """``out_path`` holds complete lines: the first records of the input, in order, each
    with its completion, and not all of them (the run was cut short)."""
    text = out_path.read_text()
    assert text.endswith("\n"), "every line is complete"
    out = [json.loads(line) for line in text.splitlines()]
    assert 0 < len(out) < len(records), len(out)
    assert [o["id"] for o in out] == [r["id"] for r in records[:len(out)]]
    assert all(o["finish_reason"] in ("stop", "length") and o["completion_ids"]
               for o in out)
    return out


def test_an_interrupted_run_keeps_the_records_it_finished(bad_input_assets, tmp_path,
                                                          capsys, monkeypatch):
    """Ctrl-C before the last batch: the command ends (130, one line), and --output holds
    the records finished so far, equal to what an uninterrupted run writes for them."""
    import lmforge.cli.generate as cli_generate

    records = _prompts(tmp_path / "p.jsonl", 20)
    argv = ["generate", "--model", str(bad_input_assets["model"]), "--prompts",
            str(tmp_path / "p.jsonl"), "--batch-size", "1", "--max-new-tokens", "4",
            "--device", "cpu"]
    assert main(argv + ["--output", str(tmp_path / "whole.jsonl")]) == 0
    whole = (tmp_path / "whole.jsonl").read_text().splitlines()
    calls = []

    def interrupt_late(done, total, rate):
        calls.append(done)
        if len(calls) == total - 1:
            raise KeyboardInterrupt

    monkeypatch.setattr(cli_generate, "_progress", interrupt_late)
    capsys.readouterr()
    assert main(argv + ["--output", str(tmp_path / "out.jsonl")]) == 130
    err = capsys.readouterr().err.strip()
    out = _assert_a_finished_prefix(tmp_path / "out.jsonl", records)
    assert err == (f"lmforge: interrupted: {tmp_path / 'out.jsonl'} holds the first "
                   f"{len(out)} of 20 records")
    assert (tmp_path / "out.jsonl").read_text().splitlines() == whole[:len(out)]


def test_a_killed_run_keeps_the_records_it_finished(bad_input_assets, tmp_path):
    """kill -9 once the first records are in: they stay, complete lines in input order."""
    records = _prompts(tmp_path / "p.jsonl", 3000)
    out_path = tmp_path / "out.jsonl"
    run = subprocess.Popen(
        [sys.executable, "-m", "lmforge.cli", "generate", "--model",
         str(bad_input_assets["model"]), "--prompts", str(tmp_path / "p.jsonl"),
         "--output", str(out_path), "--batch-size", "1", "--max-new-tokens", "40",
         "--device", "cpu"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not (out_path.exists() and out_path.read_text().count("\n") >= 1):
            assert run.poll() is None, run.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "no record written within 120 s"
            time.sleep(0.05)
    finally:
        run.send_signal(signal.SIGKILL)
        run.wait()
        run.stderr.close()
    _assert_a_finished_prefix(out_path, records)
    assert sorted(os.listdir(tmp_path)) == ["out.jsonl", "p.jsonl"], "no temporary left"


def test_the_weights_are_packed_once_for_every_group(bad_input_assets, tmp_path,
                                                     monkeypatch):
    """--prompts decodes in groups of batches; the CPU decode's packed weights are made
    once for all of them, not once a group."""
    from helpers.packing import record_packings

    packed = record_packings(monkeypatch)
    _prompts(tmp_path / "p.jsonl", 20)  # (batch 1: groups of 8, so three groups)
    assert main(["generate", "--model", str(bad_input_assets["model"]), "--prompts",
                 str(tmp_path / "p.jsonl"), "--batch-size", "1", "--max-new-tokens", "2",
                 "--device", "cpu", "--output", str(tmp_path / "o.jsonl")]) == 0
    assert packed[0] > 0 and packed[1:] and not any(packed[1:]), packed
