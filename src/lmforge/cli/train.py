"""``lmforge train``."""
from __future__ import annotations

import os
import sys
import time

from lmforge.cli.common import add_config_arguments, config_and_overrides
from lmforge.config import ConfigError, load_config
from lmforge.parallel.mesh import read_dist_env
from lmforge.train.loop import train


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a model (no config: the embedded CPU demo)",
                       description="Train a model. Without CONFIG, runs the embedded demo: a "
                       "tiny Llama trained on the CPU on the Python standard library.")
    add_config_arguments(p)
    p.set_defaults(func=_train)


# How long a rank other than 0 that refused the config waits before exiting: rank 0,
# refusing it alike, says why and exits first, so the launcher stops the others (torchrun
# would otherwise kill rank 0 before it prints, when another rank exits first).
QUIET_RANK_EXIT_DELAY_S = 10.0


def _train(args) -> int:
    env = read_dist_env()
    try:
        train(load_config(*config_and_overrides(args.config, args.overrides)))
    except ConfigError:
        if env.rank != 0:  # every rank refuses a config alike: rank 0 alone says why
            time.sleep(QUIET_RANK_EXIT_DELAY_S)
            return 2
        raise
    if env.torchrun:
        _leave_without_teardown()
    return 0


def _leave_without_teardown() -> None:
    """A torchrun worker whose run finished (checkpoint committed, export written, process
    groups destroyed) exits here, skipping interpreter teardown: there, a gloo transport
    thread still alive can make the C++ runtime abort ("terminate called without an active
    exception"), and torchrun would then report a successful run as failed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
