"""The kill matrix (slow): every writing command x SIGKILL at three points x rerun with and
without --overwrite, and x a 5 MB disk (``scripts/kill_matrix.py``; its docstring says what passes)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_every_writer_survives_kills_and_a_full_disk(tmp_path, capsys):
    path = Path(__file__).resolve().parents[2] / "scripts" / "kill_matrix.py"
    spec = importlib.util.spec_from_file_location("kill_matrix", path)
    matrix = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(matrix)
    status = matrix.main(["--work", str(tmp_path)])
    out = capsys.readouterr().out
    assert "PASS" in out and status == 0, out
