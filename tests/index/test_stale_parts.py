"""Parts folders of killed on-disk builds: removed by the next build (never by a reader); live ones kept."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from triclip.index import store
from triclip.index.sources import IndexBuildConfig, build_index
from triclip.index.build import OWNER, claim_parts, remove_stale_parts
from triclip.index.search import Searcher
from triclip.model.shards import EmbedConfig, embed_to_shards

REPO = Path(__file__).resolve().parents[2]
# A build that made its parts folder, claimed it and was then killed (SIGKILL: no cleanup ran).
HOLDER = """
import sys, time
from pathlib import Path
from triclip.index.build import claim_parts
work = Path(sys.argv[1]); work.mkdir(); (work / "image.m8.part00000.faiss").write_bytes(b"x" * 1000)
fd = claim_parts(work)
print("ready", flush=True)
time.sleep(600)
"""


def running_build_parts(folder: Path) -> subprocess.Popen:
    """Make ``folder`` the way a build does, in another process that keeps running."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    assert (folder / OWNER).read_text().startswith(f"pid {proc.pid} host ")
    return proc


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)  # no cleanup runs
    proc.wait(timeout=30)
    proc.stdout.close()


def killed_build_parts(folder: Path) -> Path:
    """Make ``folder`` the way a build does, in another process, and SIGKILL that process."""
    kill(running_build_parts(folder))
    return folder


@pytest.fixture(scope="module")
def emb(run_dir, shapes_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("emb") / "emb"
    embed_to_shards(EmbedConfig(run=str(run_dir), data=str(shapes_dir / "train.jsonl"), out=str(out), shard_size=25))
    return out


def _config(emb: Path, out: Path) -> IndexBuildConfig:
    return IndexBuildConfig(embeddings=str(emb), out=str(out), dims=[8], factory="IVF8,Flat", on_disk="always", tune_queries=50)


def test_next_build_removes_killed_builds_parts_keeps_live_ones_same_result(emb, tmp_path, capsys):
    clean = tmp_path / "clean" / "index"
    clean.parent.mkdir()
    build_index(_config(emb, clean))
    root = tmp_path / "busy"
    root.mkdir()
    out = root / "index"
    dead = killed_build_parts(root / ".index.dead1234.shard-parts")
    dead_torchrun = killed_build_parts(root / ".index.shard-parts")
    live = root / ".index.live5678.shard-parts"
    live.mkdir()
    fd = claim_parts(live)  # this process's build, still running
    old = root / ".index.oldtric.shard-parts"  # an older triclip's: no owner file
    old.mkdir()
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    other = root / ".other.dead9999.shard-parts"  # another output's: not this build's business
    other.mkdir()
    try:
        capsys.readouterr()
        summary = build_index(_config(emb, out))
        err = capsys.readouterr().err
        assert not dead.exists() and not dead_torchrun.exists()
        assert f"removed {dead}: parts of a killed index build" in err
        assert f"removed {dead_torchrun}: parts of a killed index build" in err
        assert live.is_dir() and (live / OWNER).exists()
        assert old.is_dir() and f"kept {old}: it has no owner record" in err
        assert other.is_dir()
        assert sorted(p.name for p in root.iterdir()) == sorted(["index", live.name, old.name, other.name])
    finally:
        os.close(fd)
    # the build's result does not depend on the leftovers
    assert summary["on_disk"]["image"] == {"8": "image.m8.ivfdata", "32": "image.m32.ivfdata"}
    a, b = store.load_contents(clean), store.load_contents(out)
    assert list(a.meta) == list(b.meta) and (a.vectors == b.vectors).all()  # rows read lazily: compared as lists
    for key in ("factories", "nprobe", "count", "on_disk"):
        assert a.manifest[key] == b.manifest[key]
    queries = ["a red circle", "two blue squares"]
    hits_a = Searcher.load(clean).search_text(queries, k=5, m=8)
    hits_b = Searcher.load(out).search_text(queries, k=5, m=8)
    assert [[h["id"] for h in q] for q in hits_a] == [[h["id"] for h in q] for q in hits_b]
    assert len(hits_a[0]) == 5


def test_searcher_load_leaves_parts_to_the_next_build(emb, tmp_path, capsys):
    """A read never deletes: parts of killed builds go at the next build (remove_stale_parts)."""
    out = tmp_path / "index"
    build_index(_config(emb, out))
    dead = killed_build_parts(tmp_path / ".index.abcd.shard-parts")
    live = tmp_path / ".index.efgh.shard-parts"
    proc = running_build_parts(live)  # another process's build, running
    try:
        Searcher.load(out)
        assert dead.is_dir() and live.is_dir()
        assert remove_stale_parts(out) == [dead] and live.is_dir()
    finally:
        kill(proc)
    assert remove_stale_parts(out) == [live] and not live.exists()  # killed now: the next look removes it
