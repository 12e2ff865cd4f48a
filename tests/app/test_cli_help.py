"""Every option of every command has help and shows its default (issue 26 item 5: ``triclip app --help``
had no description for --index, --host or --port and showed no defaults)."""

from __future__ import annotations

import argparse

from triclip.app.cli import build_parser, main


def _parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command path, parser) for the top parser and every subcommand, depth first."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


def _options():
    """(command, action, its help as --help prints it) for every argument a user can type."""
    for path, parser in _parsers(build_parser()):
        formatter = parser._get_formatter()
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            shown = formatter._expand_help(action) if action.help else ""
            yield " ".join(path), action, shown


def _needs_default(action: argparse.Action) -> bool:
    """An option whose default is a value a user could want to know (not off, not required, not unset)."""
    value = action.default
    return bool(action.option_strings) and not action.required and value not in (None, False, [], "") and action.nargs != 0


def test_every_option_of_every_command_has_help():
    bare = [f"{command} {action.option_strings or action.dest}" for command, action, shown in _options() if not shown.strip()]
    assert bare == []


def test_every_option_with_a_default_shows_it():
    hidden = [
        f"{command} {action.option_strings[0]} (default {action.default!r})"
        for command, action, shown in _options()
        if _needs_default(action) and "default" not in shown.lower()
    ]
    assert hidden == []


def test_the_walk_covers_every_command_and_the_app_options(capsys):
    commands = {command for command, _, _ in _options()}
    assert {"train", "eval", "solve", "embed", "index build", "index rollback", "search", "app", "demo", "data split"} <= commands
    try:
        main(["app", "--help"])
    except SystemExit as done:
        assert done.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 127.0.0.1, this machine only)" in text and "(default: 7860)" in text and "index folder to serve" in text
