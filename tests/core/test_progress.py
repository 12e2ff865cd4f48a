"""triclip.core.progress: tqdm on a terminal, whole lines (no carriage returns) in a log."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

from triclip.core import progress as prog
from triclip.core.progress import PlainProgress, progress

ROOT = Path(__file__).resolve().parents[2]


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_tqdm_and_a_log_gets_lines():
    from tqdm import tqdm

    bar = progress(range(3), desc="x", file=_Tty())
    assert isinstance(bar, tqdm)
    list(bar)
    log = io.StringIO()
    assert list(progress(range(3), desc="x", file=log)) == [0, 1, 2]
    assert "\r" not in log.getvalue()
    assert log.getvalue().splitlines()[-1].startswith("x: 3/3 it (100%)")


def test_lines_at_each_tenth_and_a_summary(monkeypatch):
    monkeypatch.setattr(prog, "MIN_GAP", 0.0)
    log = io.StringIO()
    for _ in progress(range(50), desc="caching", unit=" img", file=log):
        pass
    lines = log.getvalue().splitlines()
    assert len(lines) == 10  # 10%, 20%, ... 100%: that line is the summary, not printed twice
    assert lines[0].startswith("caching: 5/50 img (10%)") and lines[-1].startswith("caching: 50/50 img (100%)")
    assert sum("(100%)" in line for line in lines) == 1


def test_the_end_is_one_line_with_the_last_postfix(monkeypatch):
    monkeypatch.setattr(prog, "MIN_GAP", 0.0)
    log = io.StringIO()
    with progress(total=2, desc="epoch 1/2", file=log) as bar:
        bar.update(1)  # 50%: a line
        bar.set_postfix(loss="0.7")
        bar.update(1)  # 100%: left to the summary
        bar.set_postfix(loss="0.5")  # the step's loss comes after its update, as in training
    lines = log.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith("epoch 1/2: 1/2 it (50%)") and lines[1].endswith("loss=0.5")
    inner = io.StringIO()
    list(progress(range(3), leave=False, file=inner))  # no summary to come: the end is not held back
    assert inner.getvalue().splitlines()[-1].startswith("3/3 it (100%)")
    log = io.StringIO()
    with progress(total=3, desc="x", file=log) as bar:
        bar.update(2)  # stopped early, right after a line: that line stands as the last
    assert [line.split(",")[0] for line in log.getvalue().splitlines()] == ["x: 2/3 it (67%)"]


def test_manual_updates_postfix_silent_and_leave(monkeypatch):
    log = io.StringIO()
    with progress(total=4, desc="epoch 1/2", initial=1, file=log) as bar:
        bar.update(3)
        bar.set_postfix(loss="0.5")
    assert log.getvalue().splitlines()[-1].startswith("epoch 1/2: 4/4 it (100%)")
    assert log.getvalue().rstrip().endswith("loss=0.5")
    quiet = io.StringIO()
    assert list(progress(range(5), disable=True, file=quiet)) == list(range(5)) and quiet.getvalue() == ""
    inner = io.StringIO()
    list(progress(range(5), leave=False, file=inner))  # an inner loop: no summary line
    assert inner.getvalue() == ""
    unknown = io.StringIO()
    list(progress(iter(range(4)), desc="reading", file=unknown))  # no total: a count, no share
    assert unknown.getvalue().startswith("reading: 4 it,")
    assert isinstance(progress(range(2), file=io.StringIO()), PlainProgress)


def test_a_command_piped_to_a_file_writes_no_carriage_returns(tmp_path):
    """``triclip data prepare`` with stderr a pipe: whole lines only."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "triclip", "data", "prepare", "shapes", "--out", str(tmp_path / "s"), "--num", "120"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "\r" not in done.stderr and "\r" not in done.stdout
    assert "shapes: 120/120 img (100%)" in done.stderr


def test_the_packages_show_progress_only_through_this_helper():
    """tqdm is imported by triclip.core.progress alone: every bar follows the terminal / log rule."""
    offenders = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "triclip").rglob("*.py")
        if path != ROOT / "triclip" / "core" / "progress.py" and ("from tqdm" in path.read_text() or "import tqdm" in path.read_text())
    ]
    assert offenders == []


def test_plain_lines_show_the_time_left_from_the_rate_of_this_run_only():
    log = io.StringIO()
    bar = progress(desc="adding", total=100, unit="row", initial=40, file=log)
    bar.start -= 10.0  # 10 s ago: 20 rows in 10 s, 40 rows left
    bar.last -= 10.0
    bar.update(20)
    bar.update(40)
    bar.close()
    lines = log.getvalue().splitlines()
    assert lines[0].startswith("adding: 60/100 row (60%), 10.0 s, 2 row/s, ETA 20 s"), lines  # not 6 row/s
    assert "ETA" not in lines[-1]  # nothing left at the end
