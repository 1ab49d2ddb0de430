"""The ``lmforge`` command, the only place that knows argparse: one module per command
family registers its subcommands (``add_parser``) and calls the library.

Bad input exits with status 2 and one line saying what is wrong; set LMFORGE_DEBUG=1 for
the full traceback. A reader that closes stdout early (``lmforge estimate --json | head
-c 100``) ends the command quietly with status 141 (128 + SIGPIPE, what a shell reports for
cat or seq there); one gone from stderr only silences the messages (``cli.common.note``).
Ctrl-C ends a command with one line and status 130 (128 + SIGINT); `train` stops its steps
as SIGTERM does (a checkpoint, status 75), `generate --prompts` keeps the records it
finished.
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings
from importlib.metadata import PackageNotFoundError, version

from lmforge.cli import (bench_eval, data, eval_sft, evaluate, export, generate, launch, lora,
                         perf, train)
from lmforge.cli.common import (INTERRUPTED, DefaultsHelpFormatter, note, parsers_under,
                                reader_gone, silence)

# Errors a user can cause and fix: reported as one line, never as a traceback.
USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError,
               PermissionError)
READER_GONE = 141  # the status of a command whose stdout lost its reader
COMMAND_MODULES = (train, evaluate, eval_sft, bench_eval, generate, data, export, perf, launch,
                   lora)


def main(argv: list[str] | None = None) -> int:
    try:
        try:
            code = _main(argv)
        except SystemExit as e:  # argparse's --help, --version and usage errors
            code = e
        sys.stdout.flush()  # (a reader gone shows here, not in the interpreter's exit)
    except BrokenPipeError:
        if not reader_gone():
            raise
        silence(sys.stdout, sys.stderr)
        return READER_GONE
    if isinstance(code, SystemExit):
        raise code
    return code


def _main(argv: list[str] | None) -> int:
    warnings.formatwarning = plain_warning
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:  # (Ctrl-C where the command has no handler of its own)
        note("lmforge: interrupted")
        return INTERRUPTED
    except USER_ERRORS as e:
        return _fail(e, 2)
    except FloatingPointError as e:  # train.on_nonfinite=stop: the run diverged
        return _fail(e, 3)
    except RuntimeError as e:
        if not lost_peer(e):
            raise
        return _fail(RuntimeError(
            f"rank {os.environ.get('RANK', 0)}: a collective failed ({e}): another rank died "
            f"or stopped answering (torchrun's failure report names it); with torchrun "
            f"--max-restarts, or a requeued job, the run resumes from its last complete "
            f"checkpoint"), 1)


# What the backends say when a rank of the job is gone (gloo, NCCL, the store).
LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
             "NCCL communicator was aborted", "Timed out", "timed out", "watchdog")


def lost_peer(error: RuntimeError) -> bool:
    """Whether ``error`` is a collective that failed because another rank is gone."""
    import torch.distributed as dist  # (only then: the CLI's other commands need no torch)

    return isinstance(error, dist.DistError) or any(s in str(error) for s in LOST_PEER)


def _fail(error: Exception, code: int) -> int:
    if os.environ.get("LMFORGE_DEBUG"):
        raise error
    message = " ".join(str(error).split()) or type(error).__name__
    note(f"lmforge: error: {message}")
    return code


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_python_format = warnings.formatwarning


def plain_warning(message, category, filename, lineno, line=None) -> str:
    """lmforge's own warnings as one plain line (``lmforge: warning: ...``), not Python's
    ``File:LINE: UserWarning:`` with the source line; other packages' keep Python's form."""
    if os.path.abspath(filename).startswith(_PACKAGE_DIR + os.sep):
        return f"lmforge: warning: {' '.join(str(message).split())}\n"
    return _python_format(message, category, filename, lineno, line)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lmforge",
        description="Pretrain and fine-tune Llama, Mistral, Qwen2/3, GPT-J, Phi-3 and "
                    "Gemma 3 models.")
    parser.add_argument("--version", action="version", version=f"lmforge {_version()}")
    sub = parser.add_subparsers(metavar="COMMAND")
    for module in COMMAND_MODULES:
        module.add_parser(sub)
    for p in parsers_under(parser):  # one rule for every command's --help
        p.formatter_class = DefaultsHelpFormatter
    return parser


def _version() -> str:
    try:
        return version("lmforge")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"
