"""``lmforge train``."""
from __future__ import annotations

from lmforge.cli.common import add_config_arguments, config_and_overrides
from lmforge.config import load_config
from lmforge.train.loop import train


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a model (no config: the embedded CPU demo)",
                       description="Train a Llama. Without CONFIG, runs the embedded demo: a "
                       "tiny Llama trained on the CPU on the Python standard library.")
    add_config_arguments(p)
    p.set_defaults(func=_train)


def _train(args) -> int:
    train(load_config(*config_and_overrides(args.config, args.overrides)))
    return 0
