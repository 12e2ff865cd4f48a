"""pyflakes over the project's Python: no undefined name, no variable assigned and never read, no import
shadowed by a loop, no name defined twice in the library.

Two of its messages are left out: an unused import (the library re-exports names and imports optional
packages to check they are there; tests import the fixtures they use by name) and, in tests only, a name
redefined before use (a test's parameter named after an imported fixture is how pytest is told to use it).
"""

from pathlib import Path

import pytest
from pyflakes import api, messages, reporter

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("triclip", "benchmarks", "scripts", "tests")


class _Collect(reporter.Reporter):
    """Keeps every message instead of printing it."""

    def __init__(self):
        self.found: list = []

    def flake(self, message):
        self.found.append(message)

    def unexpectedError(self, filename, msg):
        self.found.append(f"{filename}: {msg}")

    def syntaxError(self, filename, msg, lineno, offset, text):
        self.found.append(f"{filename}:{lineno}: {msg}")


def flakes(source: str, filename: str) -> list:
    """pyflakes' messages on ``source`` that this project counts (the module docstring says which it does not)."""
    collect = _Collect()
    api.check(source, filename, collect)
    in_tests = filename.startswith("tests")
    return [m for m in collect.found if not isinstance(m, messages.UnusedImport)
            and not (in_tests and isinstance(m, messages.RedefinedWhileUnused))]


def test_pyflakes_finds_nothing_the_project_counts():
    found = [str(m) for folder in FOLDERS for f in sorted((ROOT / folder).rglob("*.py"))
             for m in flakes(f.read_text(encoding="utf-8"), str(f.relative_to(ROOT)))]
    assert found == []


@pytest.mark.parametrize("source, counted", [
    ("def f():\n    return g()\n", "undefined name 'g'"),
    ("from array import array\ndef f(xs):\n    for array in xs:\n        pass\n", "shadowed by loop variable"),
    ("def f():\n    x = 1\n", "local variable 'x' is assigned to but never used"),
    ("def f():\n    pass\ndef f():\n    pass\n", "redefinition of unused 'f'"),
])
def test_each_counted_message_is_caught_and_an_unused_import_is_not(source, counted):
    assert [counted in str(m) for m in flakes(source, "triclip/x.py")] == [True]
    assert flakes("import os\n", "triclip/x.py") == []
    assert flakes("from a import fixture\ndef test(fixture):\n    pass\n", "tests/x.py") == []
