"""Pool workers end with a parent killed by SIGKILL (triclip.core.workers), as the thumbnail pool's do."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

PARENT = textwrap.dedent("""
    import multiprocessing, os, sys, time
    from triclip.core.workers import die_with_parent

    def job(path):  # a long job, then a write: what a surviving worker would do after its parent's death
        time.sleep(20)
        open(path, "w").write("written after the parent died")
        return os.getpid()

    if __name__ == "__main__":
        out, watched = sys.argv[1], sys.argv[2] == "watched"
        args = (die_with_parent, (os.getpid(),)) if watched else ()
        pool = multiprocessing.get_context("fork").Pool(2, *args)
        pool.map_async(job, [out + ".a", out + ".b"], chunksize=1)
        time.sleep(1.0)  # the jobs have started
        print(" ".join(str(p.pid) for p in pool._pool), flush=True)
        time.sleep(60)
""")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in state  # a zombie no one reaps is dead


def _kill_parent(tmp_path: Path, mode: str) -> list[int]:
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    parent = subprocess.Popen([sys.executable, str(script), str(tmp_path / "out"), mode], stdout=subprocess.PIPE,
                              text=True, env=env)
    workers = [int(p) for p in parent.stdout.readline().split()]
    assert len(workers) == 2 and all(_alive(p) for p in workers)
    parent.send_signal(signal.SIGKILL)
    parent.wait(timeout=10)
    return workers


def test_watched_workers_end_at_once_when_the_parent_is_killed(tmp_path):
    workers = _kill_parent(tmp_path, "watched")
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in workers), "a worker outlived its killed parent"
    assert not list(tmp_path.glob("out.*")), "a worker wrote after its parent died"


def test_unwatched_workers_outlive_the_parent(tmp_path):
    """The control: without die_with_parent, the same workers are still running seconds after the kill."""
    workers = _kill_parent(tmp_path, "plain")
    time.sleep(2)
    try:
        assert all(_alive(p) for p in workers)
    finally:
        for p in workers:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
