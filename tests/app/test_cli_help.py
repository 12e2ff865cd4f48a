"""Every option of every command has help and shows its default (``triclip app --help``
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
    assert "127.0.0.1 is this machine only (default: 127.0.0.1)" in text and "(default: 7860)" in text
    assert "index folder to serve" in text


def test_the_apps_address_is_defined_once_and_the_docs_say_it():
    """``app``, ``demo`` and ``serve`` take HOST and PORT from triclip.app.config; the docs' URLs and defaults match."""
    import inspect
    import re
    from pathlib import Path

    from triclip.app.config import HOST, PORT, AppConfig, DemoConfig
    from triclip.app.gradio_app import serve

    assert (AppConfig(index="i").host, AppConfig(index="i").port) == (DemoConfig().host, DemoConfig().port) == (HOST, PORT)
    defaults = inspect.signature(serve).parameters
    assert (defaults["host"].default, defaults["port"].default) == (HOST, PORT)
    root = Path(__file__).resolve().parents[2]
    urls = re.findall(r"http://([\d.]+):(\d+)/", (root / "README.md").read_text(encoding="utf-8"))
    assert urls and set(urls) == {(HOST, str(PORT))}
    assert f"[--host {HOST}] [--port {PORT}]" in (root / "docs/CONTRACT.md").read_text(encoding="utf-8")


def test_no_parser_takes_abbreviations():
    """Every argparse parser in triclip/, benchmarks/ and scripts/ says allow_abbrev=False (``--val-dat`` is not
    ``--val-data``); the CLI's own parser class makes it the default of every sub-command."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    lax = []
    for path in [*root.glob("triclip/**/*.py"), *root.glob("benchmarks/*.py"), *root.glob("scripts/*.py")]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            called = getattr(node, "func", None)
            name = getattr(called, "attr", getattr(called, "id", ""))
            if isinstance(node, ast.Call) and name in ("ArgumentParser", "add_parser"):
                given = {k.arg: k.value for k in node.keywords}
                parser_class = path.name == "cli.py" and name == "add_parser"  # _Parser: allow_abbrev False
                if not parser_class and not (isinstance(given.get("allow_abbrev"), ast.Constant)
                                             and given["allow_abbrev"].value is False):
                    lax.append(f"{path.relative_to(root)}:{node.lineno}")
    assert lax == []
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices
    assert not sub["train"].allow_abbrev and not sub["index"]._subparsers._group_actions[0].choices["build"].allow_abbrev


def test_help_shows_an_escape_as_a_user_types_it():
    """``--sep``'s help said ``"\\\\t"`` (a doubled backslash): a user types ``\\t`` for a tab."""
    doubled = [f"{command} {action.option_strings[0]}" for command, action, shown in _options()
               if action.option_strings and "\\\\" in shown]
    assert doubled == []
    assert any('"\\t" means a tab' in shown for _, action, shown in _options() if "--sep" in action.option_strings)
