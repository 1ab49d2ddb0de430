"""``--help`` of every command describes every argument and shows its default."""
import argparse

from lmforge.cli import build_parser


def _commands(parser, path=("lmforge",)):
    """(command path, parser) for the top level and every subcommand below it."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*path, name))


def _shown_default(default) -> bool:
    return not (default is None or default == [] or default is argparse.SUPPRESS)


def test_every_argument_of_every_command_has_help_showing_its_default():
    missing_help, missing_default = [], []
    commands = list(_commands(build_parser()))
    assert len(commands) > 10  # the walk reached the subcommands
    for path, parser in commands:
        formatter = parser._get_formatter()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue
            name = f"{' '.join(path)} {'/'.join(action.option_strings) or action.dest}"
            if not (action.help or "").strip():
                missing_help.append(name)
                continue
            shown = formatter._expand_help(action)  # the text --help prints
            takes_value = action.option_strings and action.nargs != 0
            if (takes_value and _shown_default(action.default)
                    and not ("default" in shown and str(action.default) in shown)):
                missing_default.append(f"{name} ({action.default!r})")
    assert missing_help == [], f"arguments without help: {missing_help}"
    assert missing_default == [], f"defaults not shown: {missing_default}"


def test_help_shows_a_default_once():
    text = build_parser()._subparsers._group_actions[0].choices["plan"].format_help()
    assert text.count("(default: 10)") == 1 and "(10)" not in text
