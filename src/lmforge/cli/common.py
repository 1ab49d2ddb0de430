"""Argument conventions shared by several commands."""
from __future__ import annotations

from pathlib import Path

DEVICES = ("auto", "cpu", "cuda")


def config_and_overrides(config: str | None, overrides: list[str]) -> tuple[str | None, list]:
    """``lmforge CMD [CONFIG.yaml] [key=value ...]``: a first argument that is an override
    (and not an existing file) means no config file was given."""
    if config is not None and "=" in config and not Path(config).exists():
        return None, [config, *overrides]
    return config, list(overrides)


def add_config_arguments(p, config_help: str = "YAML recipe (see configs/)") -> None:
    p.add_argument("config", nargs="?", help=config_help)
    p.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="config overrides, e.g. optim.lr=3e-4 train.max_steps=50")
