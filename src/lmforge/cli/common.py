"""Argument conventions shared by several commands."""
from __future__ import annotations

import argparse
import os
import select
import sys
from pathlib import Path

from lmforge.config import DEVICES, JobConfig, describe_keys
from lmforge.models.hf import load_hf_model
from lmforge.peft.adapters import load_adapter

INTERRUPTED = 130  # 128 + SIGINT: what a shell reports for a command Ctrl-C ended


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


# ------------------------------------------------------------------- pipes (Unix tool)

def note(message: str) -> None:
    """A line for the user on stderr (progress, a summary). A reader gone from stderr
    (``2>&1 | head -1``) ends these lines, never the command: its product is a file or
    stdout, and it goes on making it."""
    try:
        print(message, file=sys.stderr, flush=True)
    except BrokenPipeError:
        silence(sys.stderr)


def reader_gone() -> bool:
    """Whether stdout's or stderr's pipe has lost its reader (``| head -c 100`` read what
    it wanted): the one BrokenPipeError the command answers quietly; any other is a bug."""
    for stream in (sys.stdout, sys.stderr):
        fd = _fd(stream)
        if fd is None:
            continue
        poll = select.poll()
        poll.register(fd, select.POLLOUT)
        if any(events & (select.POLLERR | select.POLLHUP) for _, events in poll.poll(0)):
            return True
    return False


def silence(*streams) -> None:
    """Point ``streams``' file descriptors at /dev/null: what is still buffered for a pipe
    with no reader (flushed at exit) then goes nowhere instead of failing."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for stream in streams:
            fd = _fd(stream)
            if fd is not None:
                os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def _fd(stream):
    try:
        return stream.fileno()
    except (AttributeError, ValueError, OSError):  # (a test's capture has none)
        return None
