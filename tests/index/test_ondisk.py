"""IVF indexes merged on disk (OnDiskInvertedLists): same answers, movable folders, mapped not loaded, damage."""

from __future__ import annotations

import gc
import json
import shutil
from pathlib import Path

import faiss
import numpy as np
import pytest

from triclip.index import faiss_index as fi
from triclip.index import store
from triclip.index.sources import IndexBuildConfig, build_index
from triclip.index.build import ShardedBuilder
from triclip.index.vectors import prefix
from triclip.index.search import Searcher
from triclip.core.errors import UserError
from triclip.model.shards import EmbedConfig, embed_to_shards
from tests.index.conftest import unit_vectors


@pytest.mark.parametrize("factory", ["IVF32,Flat", "IVF16,PQ8"])
def test_on_disk_merge_equals_in_memory_merge_and_one_built_at_once(synthetic, factory, tmp_path):
    m = 16
    on_disk = ShardedBuilder(seed=0, work=tmp_path, on_disk="always").build(synthetic, m, factory, tag="image.m16")
    in_memory = ShardedBuilder(seed=0).build(synthetic, m, factory)
    whole = np.concatenate(synthetic.parts)  # (3000, 32)
    at_once = fi.build(prefix(whole, m), factory, seed=0)
    assert fi.is_on_disk(on_disk) and not fi.is_on_disk(in_memory) and not fi.is_on_disk(at_once)
    assert Path(fi.on_disk_lists(on_disk).filename) == tmp_path / "image.m16.ivfdata"
    # parts and trained index removed; the merged index kept for a resumed build (the build removes the folder)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["image.m16.ivfdata", "image.m16.merged.faiss"]
    queries = prefix(whole[::37], m)
    params = fi.SearchParams(nprobe=4)
    s1, i1 = fi.search(on_disk, queries, 10, params)
    for other in (in_memory, at_once):
        s2, i2 = fi.search(other, queries, 10, params)
        np.testing.assert_array_equal(i1, i2)
        np.testing.assert_allclose(s1, s2, rtol=0, atol=1e-5)
    assert on_disk.ntotal == 3000
    assert (i1[:, 0] == np.arange(0, 3000, 37)).mean() > 0.9  # ids are global rows across the shard offsets


def test_auto_goes_on_disk_only_beyond_the_budget(synthetic, tmp_path):
    index = fi.new_index(16, "IVF32,Flat")  # lists: 3000 x (64 bytes of codes + 8 of id) = 216,000 bytes
    assert fi.ivf_list_bytes(index, 3000) == 216_000
    assert ShardedBuilder(0, on_disk="auto", budget=200_000).wants_disk(index, 3000)
    assert not ShardedBuilder(0, on_disk="auto", budget=300_000).wants_disk(index, 3000)
    assert not ShardedBuilder(0, on_disk="never", budget=1).wants_disk(index, 3000)
    assert not ShardedBuilder(0, on_disk="auto", budget=1).wants_disk(fi.new_index(16, "Flat"), 3000)
    with pytest.raises(UserError, match="not an IVF index"):
        ShardedBuilder(0, work=tmp_path, on_disk="always").build(synthetic, 16, "HNSW32")


def _rss_anon_mb() -> float:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("RssAnon:")) / 1024


def test_reading_maps_the_lists_instead_of_loading_them(tmp_path):
    """A 40 MB lists file: reading and searching the index leaves the process's own memory almost unchanged."""
    rng = np.random.default_rng(0)
    x = unit_vectors(rng, 300_000, 32)  # codes: 300k x 128 bytes = 38 MB
    trained = fi.new_index(32, "IVF16,Flat")
    trained.train(x[:20_000])
    files = []
    for s, start in enumerate((0, 150_000)):
        part = faiss.clone_index(trained)
        part.add_with_ids(x[start : start + 150_000], np.arange(start, start + 150_000, dtype=np.int64))
        files.append(tmp_path / f"part{s}.faiss")
        fi.save(part, files[-1])
    merged = fi.merge_on_disk(trained, files, [150_000, 150_000], tmp_path / "lists.ivfdata")
    for file in files:  # 80 MB that pytest would keep
        file.unlink()
    fi.relocate_lists(merged, "lists.ivfdata")
    fi.save(merged, tmp_path / "index.faiss")
    queries = x[:5].copy()
    del merged, part, x
    gc.collect()
    before = _rss_anon_mb()
    index = fi.load(tmp_path / "index.faiss", on_disk=True)
    _, ids = fi.search(index, queries, 1, fi.SearchParams(nprobe=16))
    assert fi.on_disk_lists(index).prefetch_nthread == fi.PREFETCH_THREADS
    assert fi.on_disk_lists(fi.load(tmp_path / "index.faiss", True, prefetch_threads=0)).prefetch_nthread == 0
    grown = _rss_anon_mb() - before
    assert (tmp_path / "lists.ivfdata").stat().st_size > 38e6
    assert ids[:, 0].tolist() == [0, 1, 2, 3, 4]
    assert grown < 10, f"reading the on-disk index took {grown:.1f} MB of process memory"
    (tmp_path / "lists.ivfdata").unlink()


# ---------------------------------------------------------------------------- index folders


@pytest.fixture(scope="module")
def emb(run_dir, shapes_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("emb") / "emb"
    embed_to_shards(EmbedConfig(run=str(run_dir), data=str(shapes_dir / "train.jsonl"), out=str(out), shard_size=25))
    return out


@pytest.fixture(scope="module")
def ondisk_index(emb, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ondisk") / "index"
    cfg = IndexBuildConfig(embeddings=str(emb), out=str(out), dims=[8], factory="IVF8,Flat", on_disk="always", tune_queries=50)
    summary = build_index(cfg)
    assert summary["on_disk"] == {"image": {"8": "image.m8.ivfdata", "32": "image.m32.ivfdata"},
                                  "text": {"8": "text.m8.ivfdata", "32": "text.m32.ivfdata"}}
    assert not list(out.parent.glob(".*shard-parts"))  # parts folder gone, lists moved into the version
    return out


def _version(index: Path) -> Path:
    return index / store.current_version(index)


def test_on_disk_folder_is_the_in_memory_folder_and_survives_a_move(emb, ondisk_index, tmp_path):
    memory = tmp_path / "memory"
    build_index(IndexBuildConfig(embeddings=str(emb), out=str(memory), dims=[8], factory="IVF8,Flat", tune_queries=50))
    moved = tmp_path / "elsewhere" / "moved"
    shutil.copytree(ondisk_index, tmp_path / "copy")
    shutil.move(tmp_path / "copy", moved)  # the .faiss files still name the lists' old absolute paths
    a, b = store.load_contents(moved), store.load_contents(memory)
    assert isinstance(a.vectors, np.memmap) and not isinstance(b.vectors, np.memmap)
    np.testing.assert_array_equal(a.vectors, b.vectors)
    np.testing.assert_array_equal(a.text_rows, b.text_rows)
    assert a.manifest["nprobe"] == b.manifest["nprobe"]
    queries = prefix(np.asarray(a.text_vectors), 8)
    for table in ("image_indexes", "text_indexes"):
        for m in (8, 32):
            index = getattr(a, table)[m]
            assert fi.is_on_disk(index) and Path(fi.on_disk_lists(index).filename).parent == _version(moved)
            q = queries if m == 8 else np.asarray(a.text_vectors)
            s1, i1 = fi.search(index, q, 10, fi.SearchParams(nprobe=2))
            s2, i2 = fi.search(getattr(b, table)[m], q, 10, fi.SearchParams(nprobe=2))
            np.testing.assert_array_equal(i1, i2)
            np.testing.assert_allclose(s1, s2, rtol=0, atol=1e-5)


def test_searcher_answers_an_image_with_itself_from_an_on_disk_index(ondisk_index):
    searcher = Searcher.load(ondisk_index)
    meta = searcher.contents.meta
    assert all(fi.is_on_disk(i) for i in searcher.contents.image_indexes.values())
    for row in (0, 30, 60, len(meta) - 1):  # one per shard: ids across the shard offsets
        assert searcher.search_image([meta[row]["image"]], k=3)[0][0]["id"] == meta[row]["id"]
        assert searcher.search_image([meta[row]["image"]], k=3, m=8)[0][0]["id"] == meta[row]["id"]


def test_cli_on_disk_build_and_search_json_stay_clean(emb, tmp_path, capfd):
    """FAISS printf()s when it relocates lists; stdout (file descriptor 1) must hold only the JSON."""
    from triclip.app.cli import main

    index = tmp_path / "index"
    argv = ["index", "build", "--embeddings", str(emb), "--out", str(index), "--factory", "IVF8,Flat"]
    argv += ["--on-disk", "always"]
    assert main(argv) == 0
    assert json.loads(capfd.readouterr().out)["on_disk"]["image"] == {"32": "image.m32.ivfdata"}
    meta = store.load_contents(index, indexes=False).meta
    assert main(["search", "--index", str(index), "--image", meta[40]["image"], "-k", "2", "--json"]) == 0
    assert json.loads(capfd.readouterr().out)[0]["id"] == meta[40]["id"]
    assert main(argv[:-1] + ["sometimes"]) == 2


def test_damaged_lists_give_one_line(ondisk_index, tmp_path):
    index = tmp_path / "index"
    shutil.copytree(ondisk_index, index)
    lists = _version(index) / "image.m8.ivfdata"
    with open(lists, "r+b") as fh:
        fh.truncate(lists.stat().st_size // 2)
    with pytest.raises(UserError, match=r"image\.m8\.ivfdata is truncated") as err:
        store.load_contents(index)
    assert "\n" not in str(err.value)
    lists.unlink()
    with pytest.raises(UserError, match=r"damaged: image\.m8\.ivfdata is missing") as err:
        Searcher.load(index)
    assert "\n" not in str(err.value)


def test_lists_of_another_index_are_refused(ondisk_index, tmp_path):
    """The caption lists are longer than the image lists: their size passes the truncation check, their bytes
    are not the image index's (the manifest's record of the file says so)."""
    index = tmp_path / "index"
    shutil.copytree(ondisk_index, index)
    shutil.copy(_version(index) / "text.m8.ivfdata", _version(index) / "image.m8.ivfdata")
    with pytest.raises(UserError, match=r"image\.m8\.ivfdata is [\d,]+ bytes, the manifest records [\d,]+") as err:
        Searcher.load(index)
    assert "\n" not in str(err.value)


def test_add_to_an_on_disk_index_is_refused(ondisk_index, run_dir, shapes_dir, tmp_path):
    index = tmp_path / "index"
    shutil.copytree(ondisk_index, index)
    cfg = IndexBuildConfig(run=str(run_dir), data=str(shapes_dir / "val.jsonl"), out=str(index), add=True)
    with pytest.raises(UserError, match="on disk: --add is not supported"):
        build_index(cfg)
    live = store.load_contents(index)  # re-writing a live on-disk version would lose its lists: refused too
    with pytest.raises(UserError, match="cannot be extended or re-written"), store.writer_lock(index):
        store.write_version(index, live)
    assert store.load_contents(index).version == live.version  # still the same, whole version


def _rank_main(rank: int, world: int, port: int, cfg: IndexBuildConfig) -> None:
    import os

    import torch

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    faiss.omp_set_num_threads(1)
    assert build_index(cfg)["rank"] == rank


def test_two_gloo_ranks_merge_the_same_on_disk_index(emb, ondisk_index, tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = tmp_path / "double"
    cfg = IndexBuildConfig(embeddings=str(emb), out=str(out), dims=[8], factory="IVF8,Flat", on_disk="always", tune_queries=50)
    mp.spawn(_rank_main, args=(2, port, cfg), nprocs=2)
    a, b = store.load_contents(ondisk_index), store.load_contents(out)
    assert not list(tmp_path.glob(".*shard-parts"))
    assert a.manifest["on_disk"] == b.manifest["on_disk"] and a.manifest["nprobe"] == b.manifest["nprobe"]
    for table in ("image_indexes", "text_indexes"):
        assert fi.is_on_disk(getattr(b, table)[8])
        q = prefix(np.asarray(a.text_vectors), 8)
        s1, i1 = fi.search(getattr(a, table)[8], q, 10, fi.SearchParams(nprobe=2))
        s2, i2 = fi.search(getattr(b, table)[8], q, 10, fi.SearchParams(nprobe=2))
        np.testing.assert_array_equal(i1, i2)
        np.testing.assert_allclose(s1, s2, rtol=0, atol=1e-5)


def test_a_reader_keeps_its_on_disk_version_while_a_writer_replaces_it(emb, ondisk_index, tmp_path):
    index = tmp_path / "index"
    shutil.copytree(ondisk_index, index)
    old = store.load_contents(index)
    queries = np.asarray(old.text_vectors[:20])  # (20, D)
    before = fi.search(old.image_indexes[32], queries, 5, fi.SearchParams(nprobe=2))
    cfg = IndexBuildConfig(embeddings=str(emb), out=str(index), dims=[8], factory="IVF8,Flat", on_disk="always", tune_queries=50,
                                overwrite=True)  # fmt: skip
    build_index(cfg)  # keeps the old version for a rollback
    build_index(cfg)  # and this one removes it
    assert not (index / old.version).exists() and store.current_version(index) != old.version
    after = fi.search(old.image_indexes[32], queries, 5, fi.SearchParams(nprobe=2))  # lists unlinked, still mapped
    np.testing.assert_array_equal(before[1], after[1])
    new = store.load_contents(index)
    np.testing.assert_array_equal(fi.search(new.image_indexes[32], queries, 5, fi.SearchParams(nprobe=2))[1], before[1])


@pytest.mark.slow
def test_bench_shards_ondisk_matches_the_in_memory_merge(tmp_path):
    """The benchmark's command at a tiny size: both merges give the same recall; the on-disk one is on disk."""
    from benchmarks.bench_shards import main

    out = tmp_path / "bench.json"
    main(["--n", "30000", "--dim", "64", "--shard-size", "10000", "--queries", "100", "--pipelines", "shards,ondisk",
          "--workdir", str(tmp_path), "--json", str(out)])
    rows = {r["pipeline"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"shards", "ondisk", "ondisk, prefetch 0"}
    assert rows["ondisk"]["on_disk"] and not rows["shards"]["on_disk"]
    assert rows["ondisk"]["recall_at_10"] == rows["shards"]["recall_at_10"] > 0.8
    assert rows["ondisk"]["nprobe"] == rows["shards"]["nprobe"]
    assert [p.name for p in tmp_path.iterdir()] == ["bench.json"]  # shards and indexes removed
