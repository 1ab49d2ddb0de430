"""Stop signals only raise a flag while the steps run, and the handlers before are back
after; a run says at once that one came, and logs the step it stops after."""
import os
import signal

import pytest
import torch

from helpers import runs
from helpers.runs import read_metrics, tiny_overrides
from lmforge.config import load_config
from lmforge.train import loop
from lmforge.train.preempt import StopSignals

tiny_corpus = runs.tiny_corpus  # the session fixture


@pytest.fixture
def ctrl_c_handled():
    """SIGINT as an interactive Python has it (a KeyboardInterrupt): a test runner started
    in a script's background inherits it ignored, which StopSignals rightly leaves be."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_sets_the_flag_and_the_loop_stops_after_its_step(signum,
                                                                      ctrl_c_handled):
    before = signal.getsignal(signum)
    with StopSignals(torch.device("cpu")) as stop:
        assert not stop.should_stop(1) and stop.stopped_at is None
        os.kill(os.getpid(), signum)  # the process lives on: only the flag is set
        os.kill(os.getpid(), signal.SIGUSR1)  # a second signal changes nothing
        assert stop.received == signum
        assert stop.should_stop(2) and stop.stopped_at == 2
    assert signal.getsignal(signum) == before


def test_a_second_ctrl_c_is_an_interrupt_at_once(ctrl_c_handled):
    with StopSignals(torch.device("cpu")) as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.received == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_ignored_sigint_stays_ignored():
    """A run started in the background of a script ignores Ctrl-C at its terminal."""
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with StopSignals(torch.device("cpu")) as stop:
            os.kill(os.getpid(), signal.SIGINT)
            assert stop.received is None
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_run_says_at_once_that_a_stop_signal_came_and_logs_the_step_it_stops_after(
        tiny_corpus, tmp_path, monkeypatch, capfd):
    step_in_progress = loop.train_step
    said_during_the_step = []

    def signalled_mid_step(cfg, rt, model, optimizers, micro_batches, step, *rest):
        if step == 3:  # the scheduler's SIGTERM arrives while step 3 runs
            os.kill(os.getpid(), signal.SIGTERM)
            said_during_the_step.append(capfd.readouterr().err)
        return step_in_progress(cfg, rt, model, optimizers, micro_batches, step, *rest)

    monkeypatch.setattr(loop, "train_step", signalled_mid_step)
    out = tmp_path / "run"
    summary = loop.train(load_config(None, [
        *tiny_overrides(tiny_corpus, 6), "train.log_every=10", "train.save=false",
        "train.device=cpu", "train.progress_bar=false", f"train.output_dir={out}"]))
    assert summary["preempted_at"] == 3
    assert ("lmforge: SIGTERM received: stopping after this step, then a checkpoint"
            in said_during_the_step[0])
    # log_every=10: step 1 (the first) and step 3, the one the run stopped after
    assert [r["step"] for r in read_metrics(out)] == [1, 3]
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-0000003"]
