"""Runs of a benchmark's child, one new process per run, its values alternating round by round.

Shared by ``bench_first_pass`` and ``bench_bottom_pass``: each run gets an empty ``TRICLIP_CACHE`` (nothing
prepared by an earlier run), prints one ``RESULT`` line, and saves a tensor that is compared with the first
value's run bit for bit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator


def peak_gb() -> float:
    """This process's peak resident memory (``VmHWM``, what ``/usr/bin/time -v`` reports), in GB."""
    with open("/proc/self/status") as f:
        return int(f.read().split("VmHWM:")[1].split()[0]) / 1e6  # kB -> GB


def alternate(module: str, values: list[int], rounds: int, child_args: list[str]) -> Iterator[tuple[int, list[str], bool]]:
    """``python -m MODULE --child VALUE --out FILE CHILD_ARGS`` for each value, ``rounds`` times over.

    Yields (value, the fields of its RESULT line, whether its saved tensor equals the first value's).
    """
    import torch

    with tempfile.TemporaryDirectory() as work:
        first = os.path.join(work, f"{values[0]}.pt")
        for _ in range(rounds):
            for value in values:
                out = os.path.join(work, f"{value}.pt")
                env = {**os.environ, "TRICLIP_CACHE": tempfile.mkdtemp(dir=work), "HF_HUB_OFFLINE": "1"}
                command = [sys.executable, "-m", module, "--child", str(value), "--out", out, *child_args]
                done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
                fields = done.stdout.split("RESULT ")[1].split()
                yield value, fields, torch.equal(torch.load(out), torch.load(first))
