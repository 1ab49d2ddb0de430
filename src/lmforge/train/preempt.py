"""Stopping cleanly when the scheduler says time is up.

SLURM warns a job before its time limit with the signal ``--signal`` names (the script
``lmforge launch slurm`` writes asks for SIGUSR1) and ends a preempted or timed-out job
with SIGTERM. While the training steps run, either signal only raises a flag; after the
step in progress every rank agrees whether any rank saw one, and if so all of them write
a checkpoint of that step and leave, so ``train.resume=auto`` continues exactly there.
``lmforge train`` then exits with ``PREEMPTED_EXIT_CODE``. The logging rank says at once
that the signal came (a step can take minutes), and the step it ends on is logged.

Ctrl-C (SIGINT, which a terminal sends to every rank) stops the same way; a second one
is an interrupt at once (``KeyboardInterrupt``, no checkpoint). A SIGINT the process
was started ignoring (a script's background job) stays ignored.
"""
from __future__ import annotations

import os
import signal
import threading
from typing import Optional

import torch
import torch.distributed as dist

# sysexits.h's EX_TEMPFAIL ("try again later"): the run is unfinished and resumable.
PREEMPTED_EXIT_CODE = 75
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """While open (``with StopSignals(device) as stop:``), SIGUSR1, SIGTERM and SIGINT set
    a flag instead of ending the process; the previous handlers come back on exit. Outside
    the main thread, where Python cannot install handlers, nothing is installed."""

    def __init__(self, device: torch.device, announce: bool = False):
        self.device = device
        self.announce = announce  # say on stderr when a signal comes (the logging rank)
        self.received: Optional[int] = None  # the first stop signal seen by this rank
        self.stopped_at: Optional[int] = None  # the step the run stopped after
        self._previous: dict = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._note) for s in STOP_SIGNALS
                              if not _ignored(s)}
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            # None: a handler installed outside Python, which cannot be put back
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        self._previous = {}

    def _note(self, signum: int, frame) -> None:
        # A handler may run between any two bytecodes: it records and says so; the loop acts.
        if signum == signal.SIGINT and self.received is not None:
            raise KeyboardInterrupt  # (Ctrl-C again: the user will not wait for the step)
        if self.received is None:
            self.received = signum
            if self.announce:
                say_received(signum)

    def should_stop(self, step: int) -> bool:
        """Collective under torch.distributed (every rank calls it after every step): True
        on all ranks when any rank has received a stop signal, so all stop at ``step``.
        The signal reaches the ranks at slightly different moments; one stopping alone
        would leave the others waiting in the next step's collectives."""
        seen = self.received is not None
        if dist.is_initialized():
            flag = torch.tensor([int(seen)], dtype=torch.int32, device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            seen = bool(flag.item())
        if seen:
            self.stopped_at = step
        return seen


def _ignored(signum: int) -> bool:
    """SIGINT ignored by the process's parent (``cmd &`` in a script): left so."""
    return signum == signal.SIGINT and signal.getsignal(signum) == signal.SIG_IGN


def say_received(signum: int) -> None:
    """One line on stderr, from the signal handler: an unbuffered write to the file
    descriptor, since the handler may interrupt a write to ``sys.stderr`` in progress (a
    second, reentrant one into its buffer would raise). On a terminal it starts a line of
    its own, below the progress bar."""
    again = " (Ctrl-C again: stop at once, without one)" if signum == signal.SIGINT else ""
    line = (f"lmforge: {signal.Signals(signum).name} received: stopping after this step, "
            f"then a checkpoint{again}\n")
    try:
        os.write(2, (("\n" if os.isatty(2) else "") + line).encode())
    except OSError:  # no stderr to write to: the stop goes on regardless
        pass
