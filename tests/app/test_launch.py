"""``triclip launch``: torchrun for a triclip command, every option spelt as usual (``--run`` too)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch.distributed.run as torchrun

from triclip.app.cli import main
from triclip.model.shards import load_shard, read_manifest
from tests.index.conftest import make_run

ROOT = Path(__file__).resolve().parents[2]


def test_plain_torchrun_refuses_run_as_ambiguous():
    """Why launch exists: torchrun's parser reads the script's words too, and --run abbreviates two of its options."""
    with pytest.raises(SystemExit):
        torchrun.get_args_parser().parse_args(["--nproc-per-node", "2", "-m", "triclip", "embed", "--run", "R"])


def test_launch_hands_the_command_over_untouched(monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(torchrun, "run", seen.append)
    assert main(["launch", "--nproc-per-node", "2", "--master-port", "29999", "embed", "--run", "R", "--data", "D", "--out", "O"]) == 0
    args = seen[0]
    assert (args.nproc_per_node, args.master_port, args.module, args.training_script) == ("2", 29999, True, "triclip")
    assert args.training_script_args == ["embed", "--run", "R", "--data", "D", "--out", "O"]
    assert main(["launch", "--nnodes", "1", "--", "index", "build", "--embeddings", "E", "--out", "I"]) == 0
    assert seen[1].training_script_args == ["index", "build", "--embeddings", "E", "--out", "I"]
    assert main(["launch", "--nproc-per-node", "2"]) == 2
    assert "give a triclip command after torchrun's options" in capsys.readouterr().err
    assert main(["launch", "--help"]) == 0
    assert "usage: triclip launch [torchrun options] [--] COMMAND" in capsys.readouterr().out and len(seen) == 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_launch_embeds_with_two_ranks_like_one(tmp_path):
    from triclip.data.builtin import prepare

    prepare("shapes", str(tmp_path / "shapes"), num=40, seed=0)
    run = make_run(tmp_path / "run", seed=0)
    data = str(tmp_path / "shapes" / "train.jsonl")
    assert main(["embed", "--run", str(run), "--data", data, "--out", str(tmp_path / "one"), "--shard-size", "8"]) == 0
    cmd = [sys.executable, "-m", "triclip", "launch", "--nproc-per-node", "2", "--master-port", str(_free_port()), "embed",
           "--run", str(run), "--data", data, "--out", str(tmp_path / "two"), "--shard-size", "8"]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["world"] == 2
    shards = read_manifest(tmp_path / "one")["num_shards"]
    for s in range(shards):
        a, b = load_shard(tmp_path / "one", s, mmap=False), load_shard(tmp_path / "two", s, mmap=False)
        np.testing.assert_allclose(a["image"], b["image"], atol=1e-6)
        assert [r["id"] for r in a["meta"]] == [r["id"] for r in b["meta"]]
