"""Stop signals only raise a flag while the steps run, and the handlers before are back
after."""
import os
import signal

import pytest
import torch

from lmforge.train.preempt import StopSignals


@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGTERM])
def test_a_stop_signal_sets_the_flag_and_the_loop_stops_after_its_step(signum):
    before = signal.getsignal(signum)
    with StopSignals(torch.device("cpu")) as stop:
        assert not stop.should_stop(1) and stop.stopped_at is None
        os.kill(os.getpid(), signum)  # the process lives on: only the flag is set
        os.kill(os.getpid(), signal.SIGUSR1)  # a second signal changes nothing
        assert stop.received == signum
        assert stop.should_stop(2) and stop.stopped_at == 2
    assert signal.getsignal(signum) == before
