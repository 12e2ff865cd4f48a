"""The index folder's versions: concurrent writers, crash recovery, damaged parts, the old format."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from triclip.app.cli import main
from triclip.index import store
from triclip.index.sources import IndexBuildConfig, build_index
from triclip.index.search import Searcher
from triclip.data.builtin import prepare
from triclip.core.errors import UserError
from tests.index.conftest import EMBED_DIM

ROOT = Path(__file__).resolve().parents[2]


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """Three manifests of 40, 180 and 180 different shapes records (absolute image paths)."""
    out = tmp_path_factory.mktemp("shapes450")
    prepare("shapes", str(out), num=450, seed=0)
    rows = _rows(out / "train.jsonl")
    for row in rows:
        row["image"] = str((out / row["image"]).resolve())
    return _write(out / "a.jsonl", rows[:40]), _write(out / "b.jsonl", rows[40:220]), _write(out / "c.jsonl", rows[220:400])


@pytest.fixture(scope="module")
def small_index(tmp_path_factory, run_dir, parts):
    out = tmp_path_factory.mktemp("small") / "index"
    build_index(IndexBuildConfig(run=str(run_dir), data=str(parts[0]), out=str(out), dims=[8, 16], factory="Flat"))
    return out


def _copy(index: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "index"
    shutil.copytree(index, dst)
    return dst


def _check_whole(index: Path, count: int) -> None:
    contents = store.load_contents(index)
    assert len(contents.meta) == len(contents.vectors) == count
    assert len({(r["image"], tuple(r["captions"])) for r in contents.meta}) == count  # no duplicate, none lost
    assert len({r["id"] for r in contents.meta}) == count
    assert all(i.ntotal == count for i in contents.image_indexes.values())
    n_text = sum(len(r["captions"]) for r in contents.meta)
    assert len(contents.text_vectors) == len(contents.text_rows) == n_text
    assert all(i.ntotal == n_text for i in contents.text_indexes.values())
    for m, index_m in contents.image_indexes.items():  # every index row is the prefix of its stored vector
        head = contents.vectors[:, :m] / np.linalg.norm(contents.vectors[:, :m], axis=1, keepdims=True)
        np.testing.assert_allclose(index_m.reconstruct_n(0, count), head, atol=1e-5)


@pytest.mark.slow
def test_two_concurrent_add_processes_keep_every_record(tmp_path, run_dir, parts, small_index):
    index = _copy(small_index, tmp_path)
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(ROOT))
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "triclip", "index", "build", "--run", str(run_dir), "--data", str(data),
             "--out", str(index), "--add"],  # fmt: skip
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for data in parts[1:]
    ]
    results = [p.communicate(timeout=300) + (p.returncode,) for p in procs]
    for out, err, code in results:
        assert code == 0, err
    assert sorted(json.loads(out)["added"] for out, _, _ in results) == [180, 180]
    assert max(json.loads(out)["count"] for out, _, _ in results) == 400
    _check_whole(index, 400)
    assert sorted(os.listdir(index)) == [".lock", ".triclip.json", "CURRENT", "v000003"]  # old versions removed


def test_concurrent_add_threads_keep_every_record(tmp_path, run_dir, parts, small_index):
    """The same race in one process (flock locks each open file, so threads exclude each other too)."""
    index = _copy(small_index, tmp_path)
    rows = _rows(parts[1])
    chunks = [_write(tmp_path / f"part{i}.jsonl", rows[i * 15 : (i + 1) * 15]) for i in range(4)]
    errors = []

    def add(data):
        try:
            build_index(IndexBuildConfig(run=str(run_dir), data=str(data), out=str(index), add=True))
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=add, args=(c,)) for c in chunks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    _check_whole(index, 100)


def test_a_second_writer_waits_then_gives_up_with_one_line(tmp_path, small_index):
    index = _copy(small_index, tmp_path)
    held, release = threading.Event(), threading.Event()

    def hold():
        with store.writer_lock(index):
            held.set()
            release.wait(10)

    thread = threading.Thread(target=hold)
    thread.start()
    held.wait(10)
    try:
        with pytest.raises(UserError, match="another triclip process is writing") as err:
            with store.writer_lock(index, timeout=0.3):
                pass
        assert "\n" not in str(err.value)
        assert len(Searcher.load(index)) == 40  # readers do not wait for writers
    finally:
        release.set()
        thread.join()
    with store.writer_lock(index, timeout=0.3):  # free again
        pass


def test_crash_between_rename_and_pointer_recovers(tmp_path, run_dir, parts, small_index, monkeypatch):
    index = _copy(small_index, tmp_path)
    real = store._point_at
    monkeypatch.setattr(store, "_point_at", lambda root, name: (_ for _ in ()).throw(KeyboardInterrupt("crash")))
    with pytest.raises(KeyboardInterrupt):
        build_index(IndexBuildConfig(run=str(run_dir), data=str(parts[1]), out=str(index), add=True))
    monkeypatch.setattr(store, "_point_at", real)
    assert sorted(os.listdir(index)) == [".lock", ".triclip.json", "CURRENT", "v000001", "v000002"]  # v2 never live
    assert len(Searcher.load(index)) == 40  # readers see the old version, and remove nothing
    assert sorted(os.listdir(index)) == [".lock", ".triclip.json", "CURRENT", "v000001", "v000002"]
    summary = build_index(IndexBuildConfig(run=str(run_dir), data=str(parts[1]), out=str(index), add=True))
    assert summary["count"] == 220
    _check_whole(index, 220)


def test_leftovers_and_bad_pointers_are_recovered(tmp_path, small_index, run_dir, parts):
    index = _copy(small_index, tmp_path)
    (index / ".tmp-crashed").mkdir()
    (index / ".tmp-crashed" / "vectors.npy").write_bytes(b"half")
    (index / "v000005").mkdir()  # a half-written version (no manifest), and CURRENT points at it
    (index / "CURRENT").write_text("v000005\n")
    before = sorted(os.listdir(index))
    assert store.load_contents(index).version == "v000001"  # the newest complete version
    assert sorted(os.listdir(index)) == before  # a reader changes nothing
    (index / "CURRENT").unlink()  # no pointer at all
    assert len(Searcher.load(index)) == 40
    (index / "CURRENT").write_text("v000009\n")  # a pointer to a missing folder
    summary = build_index(IndexBuildConfig(run=str(run_dir), data=str(parts[1]), out=str(index), add=True))
    assert summary["count"] == 220 and (index / "CURRENT").read_text().strip() == "v000002"
    assert sorted(os.listdir(index)) == [".lock", ".triclip.json", "CURRENT", "v000002"]  # the writer cleaned up


def test_old_format_is_refused_with_rebuild(tmp_path, run_dir, parts):
    old = tmp_path / "old"
    old.mkdir()
    (old / "manifest.json").write_text(json.dumps({"format": 1, "m": 8}))
    (old / "index.faiss").write_bytes(b"x")
    with pytest.raises(UserError, match="older format.*rebuild"):
        Searcher.load(old)
    build_index(IndexBuildConfig(run=str(run_dir), data=str(parts[0]), out=str(old), dims=[8], overwrite=True))  # --overwrite replaces it
    assert sorted(os.listdir(old)) == [".lock", ".triclip.json", "CURRENT", "v000001"] and len(Searcher.load(old)) == 40


def _damage_manifest(v: Path, change) -> None:
    manifest = json.loads((v / "manifest.json").read_text())
    change(manifest)
    (v / "manifest.json").write_text(json.dumps(manifest))


DAMAGE = {
    "manifest not json": (lambda v: (v / "manifest.json").write_text("{not json"), "damaged"),
    "manifest without dims": (lambda v: _damage_manifest(v, lambda m: m.pop("dims")), "damaged"),
    "manifest of another dimension": (
        lambda v: _damage_manifest(v, lambda m: m.update(dim=64, dims=[8, 16, 64])), "expected float32 \\(40, 64\\)"),
    "manifest of another format": (lambda v: _damage_manifest(v, lambda m: m.update(format=7)), "rebuild"),
    "meta line missing": (lambda v: (v / "meta.jsonl").write_text("\n".join((v / "meta.jsonl").read_text().splitlines()[:-1])),
                          "meta.jsonl is .* bytes, the manifest records"),
    "meta line garbled": (lambda v: (v / "meta.jsonl").write_text("[1, 2]\n" * 40), "meta.jsonl"),
    "vectors truncated": (lambda v: (v / "vectors.npy").write_bytes((v / "vectors.npy").read_bytes()[:300]), "vectors.npy"),
    "vectors of another dimension": (lambda v: np.save(v / "vectors.npy", np.ones((40, 16), np.float32)), "\\(40, 16\\)"),
    "vectors with nan": (lambda v: np.save(v / "vectors.npy", np.full((40, EMBED_DIM), np.nan, np.float32)), "NaN"),
    "faiss file garbage": (lambda v: (v / "image.m8.faiss").write_bytes(b"garbage"), "image.m8.faiss"),
    "faiss file missing": (lambda v: (v / "text.m16.faiss").unlink(), "text.m16.faiss is missing"),
    "faiss index of another m": (lambda v: shutil.copy(v / "image.m16.faiss", v / "image.m8.faiss"), "dimension 16"),
    "text rows wrong": (lambda v: np.save(v / "text_rows.npy", np.zeros((3, 2), np.int64)), "text_rows.npy"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_index_is_one_line_exit_2(tmp_path, small_index, capsys, damage):
    index = _copy(small_index, tmp_path)
    harm, needle = DAMAGE[damage]
    harm(index / "v000001")
    code = main(["search", "--index", str(index), "--text", "a red circle", "--json"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert re.search(needle, err), err


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--dims", "8", "--factory", "IVF1024,Flat"], "IVF1024,Flat needs at least 1024 training vectors .* has 40 images"),
        (["--dims", "8", "--factory", "IVF4,PQ4"], "needs at least 256 training vectors"),
        (["--dims", f"8,{EMBED_DIM * 2}"], f"--dims {EMBED_DIM * 2} exceeds the model's embedding dimension D={EMBED_DIM}"),
        (["--dims", "0"], "--dims must be >= 1, got 0"),
        (["--dims", "8,x"], "comma-separated integers"),
        (["--factory", "Bogus99"], "bad FAISS factory"),
        (["--ordering", "sideways"], "invalid choice: 'sideways'"),
    ],
)
def test_build_errors_are_one_line_exit_2(tmp_path, capsys, run_dir, parts, argv, needle):
    out = tmp_path / "new"
    code = main(["index", "build", "--run", str(run_dir), "--data", str(parts[0]), "--out", str(out), *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert re.search(needle, err), err
    assert not out.exists() or store.is_empty_dir(out)  # nothing half-built is left as an index



def test_readers_during_writes_see_whole_versions(tmp_path, run_dir, parts, small_index):
    index = _copy(small_index, tmp_path)
    rows = _rows(parts[1])
    chunks = [_write(tmp_path / f"part{i}.jsonl", rows[i * 15 : (i + 1) * 15]) for i in range(3)]
    done, seen, errors = threading.Event(), set(), []

    def read():
        while not done.is_set():
            try:
                contents = store.load_contents(index)  # raises if any part disagrees with another
                seen.add(len(contents.meta))
            except BaseException as err:  # noqa: BLE001 - reported below
                errors.append(err)

    readers = [threading.Thread(target=read) for _ in range(2)]
    for t in readers:
        t.start()
    try:
        for chunk in chunks:
            build_index(IndexBuildConfig(run=str(run_dir), data=str(chunk), out=str(index), add=True))
    finally:
        done.set()
        for t in readers:
            t.join()
    assert not errors, errors[:1]
    assert seen <= {40, 55, 70, 85} and 40 in seen
    assert len(store.load_contents(index).meta) == 85
