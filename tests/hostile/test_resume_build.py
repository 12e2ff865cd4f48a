"""``index build --embeddings`` killed (SIGKILL) at a chunk, stopped by a full disk, or read while it writes.

The same command run again resumes from the parts folder the dead build left (``triclip.index.parts``): the
finished shard parts, trained and merged indexes, chosen and filled codes and the vectors file are reused, one
line says so, and the version it writes is the one an uninterrupted build writes, byte for byte (FAISS is
deterministic here; the codes' choice is made deterministic with ``--latency-ms 1000``: every code is within
the bound, so the best recall wins, not the faster of two on a busy machine).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.hostile.conftest import one_line_error
from tests.index.conftest import make_run
from triclip.data.builtin import prepare
from triclip.index.search import Searcher
from triclip.model.shards import EmbedConfig, embed_to_shards

REPO = Path(__file__).resolve().parents[2]
OPTIONS = ["--dims", "8", "--factory", "IVF8,Flat", "--on-disk", "always", "--bytes", "8", "--latency-ms", "1000",
           "--tune-queries", "50"]  # fmt: skip
# what the version holds besides its manifest and curves (which record timings): equal bytes after a resume
FILES = ["image.b8.codec", "image.m32.faiss", "image.m32.ivfdata", "image.m8.faiss", "image.m8.ivfdata", "meta.jsonl",
         "text.b8.codec", "text.m32.faiss", "text.m32.ivfdata", "text.m8.faiss", "text.m8.ivfdata", "text_rows.npy",
         "text_vectors.npy", "vectors.npy"]  # fmt: skip
SAME = ("factories", "text_factories", "nprobe", "text_nprobe", "count", "text_count", "on_disk", "dims")


@pytest.fixture(scope="module")
def emb(tmp_path_factory) -> Path:
    """Embeddings of ~90 shapes images in 9 shards of 10 rows (D = 32)."""
    root = tmp_path_factory.mktemp("resume")
    prepare("shapes", str(root / "shapes"), num=100, seed=0)
    run = make_run(root / "run", seed=0)
    out = root / "emb"
    embed_to_shards(EmbedConfig(run=str(run), data=str(root / "shapes" / "train.jsonl"), out=str(out), shard_size=10))
    return out


@pytest.fixture(scope="module")
def reference(emb, tmp_path_factory) -> Path:
    """The uninterrupted build."""
    out = tmp_path_factory.mktemp("reference") / "index"
    done = triclip(["index", "build", "--embeddings", emb, "--out", out, *OPTIONS], out.parent)
    assert done.returncode == 0, done.stderr
    return out


# The child runs PRELUDE first (optional: Python setting the library's constants, MANY_LISTS); with
# SIGNAL_AFTER="NAME:SIG" it signals itself at its first audited call after NAME is renamed into the parts folder
# (every file there is a temporary file + ``os.replace``): the signal lands exactly there, however fast it runs.
CHILD = """
import os, runpy, signal, sys
exec(os.environ.get("PRELUDE", ""))
name, sig = os.environ.get("SIGNAL_AFTER", ":").split(":")
state = []
def hook(event, args):
    if state == ["renamed"]:
        state.append("sent")
        os.kill(os.getpid(), getattr(signal, sig))
    elif not state and event == "os.rename" and os.path.basename(os.fsdecode(args[1])) == name:
        state.append("renamed")
if name:
    sys.addaudithook(hook)
sys.argv[0] = "triclip"
runpy.run_module("triclip", run_name="__main__", alter_sys=True)
"""


def triclip(args, tmp: Path, signal_after: str | None = None,
            prelude: str = "") -> subprocess.CompletedProcess | subprocess.Popen:
    """``triclip ARGS`` in a child process run to the end; or started, to signal itself after a file
    (``signal_after="NAME:SIGKILL"``). ``prelude``: Python the child runs first."""
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", TRICLIP_CACHE=str(tmp / "cache"),
               PYTHONPATH=str(REPO), PRELUDE=prelude)  # fmt: skip
    cmd = [sys.executable, "-c", CHILD, *map(str, args)]
    if signal_after:
        env["SIGNAL_AFTER"] = signal_after
        return subprocess.Popen(cmd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return subprocess.run(cmd, env=env, text=True, capture_output=True, timeout=300)


def parts_of(out: Path) -> Path:
    """The build's parts folder."""
    found = glob.glob(str(out.parent / f".{out.name}.build-*.shard-parts"))
    assert len(found) == 1, found
    return Path(found[0])


def stop_at(out: Path, name: str, args: list, tmp: Path, timeout: float = 120) -> subprocess.Popen:
    """The build started and stopped (SIGSTOP, still alive) right after ``name`` was written to its parts folder."""
    proc = triclip(args, tmp, signal_after=f"{name}:SIGSTOP")
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        assert proc.poll() is None, f"the build ended before {name} appeared: {proc.communicate()[1][-2000:]}"
        assert time.monotonic() < deadline, f"{name} did not appear within {timeout} s"
        time.sleep(0.01)
    return proc


def kill_at(out: Path, name: str, emb: Path, options=OPTIONS, prelude: str = "") -> Path:
    """The build SIGKILLed right after ``name`` was written to its parts folder; returns that folder."""
    proc = triclip(["index", "build", "--embeddings", emb, "--out", out, *options], out.parent,
                   signal_after=f"{name}:SIGKILL", prelude=prelude)  # fmt: skip
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL, err  # killed, not finished
    assert not (out / "CURRENT").exists()  # no version was written
    return parts_of(out)


def digests(index: Path, files=FILES) -> dict[str, str]:
    live = index / (index / "CURRENT").read_text().strip()
    return {f: hashlib.sha256((live / f).read_bytes()).hexdigest() for f in files}


def manifest(index: Path) -> dict:
    live = index / (index / "CURRENT").read_text().strip()
    return json.loads((live / "manifest.json").read_text())


def assert_same_index(a: Path, b: Path) -> None:
    assert digests(a) == digests(b)
    ma, mb = manifest(a), manifest(b)
    assert {k: ma.get(k) for k in SAME} == {k: mb.get(k) for k in SAME}
    codes = [{b: (v["spec"], v["recall"], v["text"]["spec"], v["text"]["recall"]) for b, v in m["budgets"].items()}
             for m in (ma, mb)]  # fmt: skip
    assert codes[0] == codes[1]
    assert hits(a) == hits(b) and len(hits(a)) == 5


def hits(index: Path) -> list[str]:
    return [h["id"] for h in Searcher.load(index).search_text(["a red circle"], k=5, m=8)[0]]


@pytest.mark.parametrize(("point", "resumed"), [
    ("image.m8.part00003.faiss", r"resuming: [4-9] of 9 shards of image m=8 done"),
    ("text.m32.part00005.faiss", r"resuming: [6-9] of 9 shards of text m=32 done"),
    ("vectors.npy", r"resuming: 9 of 9 shards of text m=32 done"),
    ("image.b8.codec.filled", r"resuming: 9 of 9 shards of text m=32 done"),
])  # fmt: skip
def test_a_build_killed_at_a_chunk_resumes_and_writes_what_an_uninterrupted_build_writes(
    emb, reference, tmp_path, point, resumed
):
    out = tmp_path / "index"
    work = kill_at(out, point, emb)
    kept = sorted(p.name for p in work.iterdir())
    assert "plan.json" in kept and point in kept
    again = triclip(["index", "build", "--embeddings", emb, "--out", out, *OPTIONS], tmp_path)
    assert again.returncode == 0, again.stderr
    assert f"resuming the build of {out} from {work}" in again.stderr
    assert re.search(resumed, again.stderr), again.stderr
    assert not work.exists()  # removed once the version is written
    assert_same_index(out, reference)


def test_other_options_after_a_kill_do_not_reuse_the_parts(emb, reference, tmp_path):
    out = tmp_path / "index"
    work = kill_at(out, "text.m8.part00002.faiss", emb)
    other = [*OPTIONS[:1], "16", *OPTIONS[2:]]  # --dims 16: other indexes
    done = triclip(["index", "build", "--embeddings", emb, "--out", out, *other], tmp_path)
    assert done.returncode == 0, done.stderr
    assert "resuming" not in done.stderr
    assert f"removed {work}: parts of a killed index build" in done.stderr
    assert not work.exists() and manifest(out)["dims"] == [16, 32]
    # the first command, run again, starts from nothing too, and writes what it writes uninterrupted
    again = triclip(["index", "build", "--embeddings", emb, "--out", out, "--overwrite", *OPTIONS], tmp_path)
    assert again.returncode == 0 and "resuming" not in again.stderr, again.stderr
    assert_same_index(out, reference)


def test_a_second_build_of_the_same_index_is_refused_while_the_first_runs(emb, reference, tmp_path):
    out = tmp_path / "index"
    first = stop_at(out, "image.m32.part00001.faiss", ["index", "build", "--embeddings", emb, "--out", out, *OPTIONS],
                    tmp_path)  # fmt: skip
    work = parts_of(out)  # the first build alive, holding its parts folder
    try:
        second = triclip(["index", "build", "--embeddings", emb, "--out", out, *OPTIONS], tmp_path)
        line = one_line_error(second.returncode, second.stderr)
        assert f"another build of {out} is running (its parts are in {work}); wait for it" in line
        assert (work / "image.m32.part00001.faiss").exists()  # its parts untouched
    finally:
        first.send_signal(signal.SIGCONT)
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    assert_same_index(out, reference)


def test_a_reader_during_the_rebuild_is_answered_from_the_live_version(emb, reference, tmp_path):
    out = tmp_path / "index"
    first = triclip(["index", "build", "--embeddings", emb, "--out", out, "--dims", "8", "--factory", "Flat"],
                    tmp_path)  # fmt: skip
    assert first.returncode == 0, first.stderr
    before, live = hits(out), (out / "CURRENT").read_text()
    build = stop_at(out, "text.m8.part00004.faiss",
                    ["index", "build", "--embeddings", emb, "--out", out, "--overwrite", *OPTIONS], tmp_path)  # fmt: skip
    # stopped in the middle of its part writes
    try:
        answer = triclip(["search", "--index", out, "--text", "a red circle", "-k", "5", "--m", "8", "--json"],
                         tmp_path)  # fmt: skip
        assert answer.returncode == 0, answer.stderr
        assert [h["id"] for h in json.loads(answer.stdout)] == before
        assert (out / "CURRENT").read_text() == live and manifest(out)["factories"]["8"] == "Flat"
    finally:
        build.send_signal(signal.SIGCONT)
    _, err = build.communicate(timeout=300)
    assert build.returncode == 0, err
    assert (out / "CURRENT").read_text() != live
    assert_same_index(out, reference)


def test_a_full_disk_during_the_part_writes_is_one_line_and_a_rerun_with_space_resumes(
    emb, reference, small_disk, tmp_path
):
    disk = small_disk(4 << 20)
    out = disk / "index"
    first = triclip(["index", "build", "--embeddings", emb, "--out", out, "--dims", "16", "--factory", "Flat"],
                    tmp_path)  # fmt: skip
    assert first.returncode == 0, first.stderr
    live = {p.name: p.read_bytes() for p in (out / (out / "CURRENT").read_text().strip()).iterdir()}
    (disk / "filler").unlink()
    small_disk(40_000)  # room for the plan and the first parts, not for all of them
    full = triclip(["index", "build", "--embeddings", emb, "--out", out, "--overwrite", *OPTIONS], tmp_path)
    line = one_line_error(full.returncode, full.stderr)
    assert "disk full" in line, full.stderr
    assert {p.name: p.read_bytes() for p in (out / (out / "CURRENT").read_text().strip()).iterdir()} == live
    work = next(disk.glob(".index.build-*.shard-parts"))
    assert "kept the finished parts in" in full.stderr and (work / "plan.json").exists()
    (disk / "filler").unlink()  # space again
    again = triclip(["index", "build", "--embeddings", emb, "--out", out, "--overwrite", *OPTIONS], tmp_path)
    assert again.returncode == 0, again.stderr
    assert re.search(r"resuming: [1-9] of 9 shards of image m=8 done", again.stderr), again.stderr
    assert not work.exists()
    assert_same_index(out, reference)


# Many lists at a toy size: the collection counts as at scale, its codes are lists refitted for N (16 lists, 4
# groups of centroids, 2 scanned per row): two-level k-means and rows assigned through groups of centroids, the
# path of N >= ~2.1M (triclip.codecs.ivf.LARGE_LISTS). Every finalist is filled whatever its encoding rate
# (timed: which ones are filled would differ between runs).
MANY_LISTS = """
from triclip.codecs import ivf
from triclip.index import budgets, finalists
ivf.IVF_MIN_N, ivf.LARGE_LISTS, ivf.ASSIGN_PROBE, ivf.LISTS_PER_ROOT, ivf.TRAIN_PER_LIST = 50, 16, 2, 1, 4
budgets.FIT_ROWS, finalists.FILL_RATIO = 60, float("inf")
"""
MANY_OPTIONS = [*OPTIONS, "--codec", "ivf"]
MANY_FILES = [*FILES, "image.b8.codec.ivfdata", "text.b8.codec.ivfdata"]


@pytest.fixture(scope="module")
def many_lists(emb, tmp_path_factory) -> Path:
    """The uninterrupted build with many lists."""
    out = tmp_path_factory.mktemp("many") / "index"
    done = triclip(["index", "build", "--embeddings", emb, "--out", out, *MANY_OPTIONS], out.parent, prelude=MANY_LISTS)
    assert done.returncode == 0, done.stderr
    for sized in (manifest(out)["budgets"]["8"]["sized_for_n"], manifest(out)["budgets"]["8"]["text"]["sized_for_n"]):
        assert sized["nlist"] == 16 and "two-level k-means" in sized["large"] and "2 scanned" in sized["large"]
    return out


@pytest.mark.parametrize("point", ["image.b8.codec.sized.pkl", "image.b8.codec.part00004.faiss",
                                   "image.b8.codec.at_n.pkl", "text.b8.codec.part00006.faiss"])  # fmt: skip
def test_a_build_of_many_lists_killed_at_its_refit_fill_or_tuning_resumes_to_the_same_index(emb, many_lists, tmp_path,
                                                                                           point):
    """Killed right after the lists refitted for N (two-level k-means), a shard of their fill through the groups
    of centroids, or their tuning at N was kept: the same command resumes and writes, byte for byte, what the
    uninterrupted build writes."""
    out = tmp_path / "index"
    work = kill_at(out, point, emb, MANY_OPTIONS, MANY_LISTS)
    assert point in {p.name for p in work.iterdir()}
    again = triclip(["index", "build", "--embeddings", emb, "--out", out, *MANY_OPTIONS], tmp_path, prelude=MANY_LISTS)
    assert again.returncode == 0, again.stderr
    assert f"resuming the build of {out} from {work}" in again.stderr and not work.exists()
    assert digests(out, MANY_FILES) == digests(many_lists, MANY_FILES)
    for side in (lambda m: m["budgets"]["8"], lambda m: m["budgets"]["8"]["text"]):
        a, b = side(manifest(out)), side(manifest(many_lists))
        assert {**a["sized_for_n"], "seconds": 0} == {**b["sized_for_n"], "seconds": 0}
        assert a["at_n"]["nprobe"] == b["at_n"]["nprobe"]  # (its curve's timings differ)
        assert [c["of_exact_top10"] for c in a["at_n"]["curve"]] == [c["of_exact_top10"] for c in b["at_n"]["curve"]]
