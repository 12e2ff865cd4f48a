"""The parts folder of a build from embedding shards: its key, taking it back, refusing a second owner; and the
builder's OpenMP threads (``triclip.codecs.threads.all_cores``)."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import faiss
import numpy as np
import pytest

from triclip.codecs import threads
from triclip.core.errors import UserError
from triclip.index import faiss_index as fi
from triclip.index.build import ShardedBuilder, add_shard
from triclip.index.config import IndexBuildConfig
from triclip.index.parts import OWNER, PLAN, build_key, open_parts, parts_folder
from triclip.index.vectors import prefix


@pytest.fixture
def shard_files(tmp_path):
    files = []
    for name in ("manifest.json", "image.npy", "meta.jsonl"):
        (tmp_path / name).write_text(name)
        files.append(tmp_path / name)
    return files


DECIDED = {"factories": {"8": "IVF8,Flat"}, "disk": {"image": {"8": True}}}


def test_the_key_changes_with_what_changes_the_result_and_only_with_that(tmp_path, shard_files):
    cfg = IndexBuildConfig(embeddings=str(tmp_path), out=str(tmp_path / "index"), dims=[8], bytes=[16])
    key, plan = build_key(cfg, shard_files, DECIDED)
    assert build_key(cfg, shard_files, DECIDED)[0] == key and json.loads(json.dumps(plan)) == plan
    same = [replace(cfg, out=str(tmp_path / "other")), replace(cfg, overwrite=True), replace(cfg, lock_timeout=1.0)]
    assert {build_key(c, shard_files, DECIDED)[0] for c in same} == {key}
    other = [replace(cfg, dims=[16]), replace(cfg, bytes=[8]), replace(cfg, seed=1), replace(cfg, on_disk="always"),
             replace(cfg, tune_queries=10), replace(cfg, text_index=False), replace(cfg, codec="pq")]  # fmt: skip
    keys = {build_key(c, shard_files, DECIDED)[0] for c in other}
    assert len(keys) == len(other) and key not in keys
    assert build_key(cfg, shard_files, {**DECIDED, "factories": {"8": "IVF16,Flat"}})[0] != key
    st = os.stat(shard_files[1])
    os.utime(shard_files[1], ns=(st.st_atime_ns, st.st_mtime_ns + 1000))  # a shard written again
    assert build_key(cfg, shard_files, DECIDED)[0] != key


def test_the_folder_of_a_key_is_taken_back_after_its_owner_died_and_refused_while_it_lives(tmp_path):
    out = tmp_path / "index"
    plan = {"options": {"seed": 0}}
    work, fd, resumed = open_parts(out, "abc", plan)
    assert work == parts_folder(out, "abc") == tmp_path / ".index.build-abc.shard-parts"
    assert not resumed and json.loads((work / PLAN).read_text()) == plan
    assert (work / OWNER).read_text().startswith(f"pid {os.getpid()} ")
    (work / "image.m8.part00000.faiss").write_text("finished")
    (work / ".tmp-abcd.faiss").write_text("half written")
    with pytest.raises(UserError, match=f"another build of {out} is running"):
        open_parts(out, "abc", plan)  # the owner lives (its flock is held)
    os.close(fd)  # the owner dies: the kernel drops its flock
    work2, fd2, resumed = open_parts(out, "abc", plan)
    try:
        assert work2 == work and resumed
        assert sorted(p.name for p in work.iterdir()) == sorted([OWNER, PLAN, "image.m8.part00000.faiss"])
    finally:
        os.close(fd2)
    # another plan under the same name (not the same build): nothing in it is reused
    work3, fd3, resumed = open_parts(out, "abc", {"options": {"seed": 1}})
    os.close(fd3)
    assert not resumed and sorted(p.name for p in work3.iterdir()) == [OWNER, PLAN]


def test_a_dead_build_of_another_key_is_removed_and_a_live_one_kept(tmp_path, capsys):
    out = tmp_path / "index"
    live, fd_live, _ = open_parts(out, "live", {})
    dead, fd_dead, _ = open_parts(out, "dead", {})
    os.close(fd_dead)
    try:
        capsys.readouterr()
        mine, fd, _ = open_parts(out, "mine", {})
        os.close(fd)
        assert not dead.exists() and live.is_dir() and mine.is_dir()
        assert f"removed {dead}: parts of a killed index build" in capsys.readouterr().err
    finally:
        os.close(fd_live)


def test_the_builder_adds_on_every_core_whatever_the_serving_count(monkeypatch):
    monkeypatch.setattr(threads, "_DEFAULT", 3)  # the process default: every core
    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)  # what a server's search left in this thread
    try:
        with threads.all_cores():
            assert faiss.omp_get_max_threads() == 3
        assert faiss.omp_get_max_threads() == 1
    finally:
        faiss.omp_set_num_threads(before)


def test_a_merge_killed_half_way_is_done_again_from_the_kept_parts(synthetic, tmp_path):
    """A build killed while it merged the parts into the lists file: the trained index and the parts are kept,
    the half-written lists file is replaced; the result is the uninterrupted build's."""
    clean = ShardedBuilder(seed=0).build(synthetic, 16, "IVF16,PQ8")  # in memory, never on disk
    builder = ShardedBuilder(seed=0, work=tmp_path, on_disk="always")
    trained = builder._trained(synthetic, 16, fi.new_index(16, "IVF16,PQ8"), tmp_path / "image.m16.trained.faiss")
    for s in range(len(synthetic.parts)):  # every part finished, then the merge was killed half-way
        part = add_shard(trained, synthetic.shard(s, 16), int(synthetic.offsets[s]))
        fi.save(part, tmp_path / f"image.m16.part{s:05d}.faiss")
    (tmp_path / "image.m16.ivfdata").write_bytes(b"\x07" * 100_000)  # the lists file the killed merge left
    resumed = builder.build(synthetic, 16, "IVF16,PQ8", tag="image.m16")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["image.m16.ivfdata", "image.m16.merged.faiss"]
    queries = prefix(np.concatenate(synthetic.parts)[::41], 16)
    params = fi.SearchParams(nprobe=16)
    np.testing.assert_array_equal(fi.search(resumed, queries, 10, params)[1], fi.search(clean, queries, 10, params)[1])


def test_the_vectors_file_is_the_shards_in_order_as_float32_and_a_finished_one_is_reused(synthetic, tmp_path):
    from triclip.index.build import stack_to_file

    file = tmp_path / "vectors.npy"
    mapped = stack_to_file(synthetic, file)  # (3000, 32), shards of float16, one empty
    assert isinstance(mapped, np.memmap) and mapped.dtype == np.float32
    np.testing.assert_array_equal(mapped, np.concatenate(synthetic.parts).astype(np.float32))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vectors.npy"]  # no temporary file left
    before = file.stat().st_mtime_ns
    np.testing.assert_array_equal(stack_to_file(synthetic, file), mapped)
    assert file.stat().st_mtime_ns == before  # an earlier run's file: read, not written again
