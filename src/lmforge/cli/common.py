"""Argument conventions shared by several commands."""
from __future__ import annotations

import argparse
from pathlib import Path

from lmforge.config import DEVICES, JobConfig, describe_keys
from lmforge.models.hf import load_hf_model
from lmforge.peft.adapters import load_adapter


def config_and_overrides(config: str | None, overrides: list[str]) -> tuple[str | None, list]:
    """``lmforge CMD [CONFIG.yaml] [key=value ...]``: a first argument that is an override
    (and not an existing file) means no config file was given."""
    if config is not None and "=" in config and not Path(config).exists():
        return None, [config, *overrides]
    return config, list(overrides)


def add_config_arguments(p, config_help: str = "YAML recipe (see configs/)",
                         list_keys: bool = False) -> None:
    """CONFIG and key=value overrides; ``list_keys``: ``--help`` ends with every config
    key, its default, what it may hold and its help (as ``validate`` reads them)."""
    p.add_argument("config", nargs="?", help=config_help)
    if list_keys:
        p.epilog = "config keys (section.key=value):\n" + describe_keys(JobConfig())
    p.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="config overrides, e.g. optim.lr=3e-4 train.max_steps=50")


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """``--help`` that shows every option's default: "(default: X)" is appended unless the
    help already says what the default is. A flag (no value) and a default of None have
    nothing to show: their help says what happens without them."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:  # laid out by its author (the config keys' list): as written
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)

    def _get_help_string(self, action) -> str:
        text = action.help or ""
        if not shows_default(action) or "default" in text:
            return text
        return f"{text} (default: %(default)s)"


def shows_default(action: argparse.Action) -> bool:
    """Whether ``action`` is an option taking a value with a default to show."""
    default = action.default
    return bool(action.option_strings) and action.nargs != 0 and not (
        default is None or default == [] or default is argparse.SUPPRESS)


def parsers_under(parser: argparse.ArgumentParser):
    """``parser`` and every subcommand parser below it, depth first."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from parsers_under(sub)


def load_scored_model(model_dir: str, adapter: str | None, device):
    """``--model`` on ``device``, with ``--adapter`` (a PEFT directory) on it when given,
    in eval mode: what the commands that score a model load."""
    model = load_hf_model(model_dir, device=device).eval()
    if adapter:
        load_adapter(model, adapter)
        model.to(device)
    return model
