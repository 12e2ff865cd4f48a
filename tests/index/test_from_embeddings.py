"""Index folders from embedding shards: merged IVF == built at once, ids right, nprobe tuned, torchrun."""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

import faiss
import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from triclip.index import faiss_index as fi
from triclip.index.sources import IndexBuildConfig, build_index
from triclip.index.build import ShardedBuilder, add_shard, choose_factory, train_once
from triclip.index.config import parse_bytes
from triclip.index.vectors import prefix
from triclip.index.search import Searcher
from triclip.index.store import load_contents
from triclip.core.errors import UserError
from triclip.model.shards import EmbedConfig, embed_to_shards


@pytest.mark.parametrize("factory", ["IVF32,Flat", "IVF16,PQ8"])
def test_merged_ivf_equals_one_built_at_once(synthetic, factory):
    m = 16
    merged = ShardedBuilder(seed=0).build(synthetic, m, factory)
    whole = np.concatenate(synthetic.parts)  # (3000, 32)
    at_once = fi.build(prefix(whole, m), factory, seed=0)  # trains on the same sample rows
    queries = prefix(whole[::37], m)
    params = fi.SearchParams(nprobe=4)
    s1, i1 = fi.search(merged, queries, 10, params)
    s2, i2 = fi.search(at_once, queries, 10, params)
    assert merged.ntotal == at_once.ntotal == 3000
    np.testing.assert_array_equal(i1, i2)
    np.testing.assert_allclose(s1, s2, rtol=0, atol=1e-5)
    assert (i1[:, 0] == np.arange(0, 3000, 37)).mean() > 0.9  # a stored vector finds itself: ids are rows


def test_merge_without_offsets_is_the_id_trap(synthetic):
    m = 16
    trained = train_once(synthetic, m, fi.new_index(m, "IVF32,Flat"), 0)
    wrong = faiss.clone_index(trained)
    for s in range(len(synthetic.parts)):
        wrong.merge_from(add_shard(trained, synthetic.shard(s, m)), 0)  # add_id = 0: every shard from row 0
    right = ShardedBuilder(seed=0).build(synthetic, m, "IVF32,Flat")
    queries = synthetic.shard(3, m)[:20]  # rows 2500..2519
    _, ids_wrong = fi.search(wrong, queries, 1, fi.SearchParams(nprobe=32))
    _, ids_right = fi.search(right, queries, 1, fi.SearchParams(nprobe=32))
    np.testing.assert_array_equal(ids_right[:, 0], np.arange(2500, 2520))
    assert ids_wrong.max() < 1400  # the last shard's rows came out as 0..499: wrong images


def test_choose_factory_by_memory_budget():
    assert choose_factory(50_000, 32, 1 << 30) == "Flat"
    assert choose_factory(1_000_000, 32, 1 << 30) == "HNSW32"
    assert choose_factory(1_000_000, 32, 200 << 20) == "IVF1024,Flat"  # 128 MB of codes fit, HNSW's links do not
    assert choose_factory(1_000_000, 32, 50 << 20) == "IVF1024,PQ8"  # beyond the budget: 8 bytes a vector
    assert choose_factory(1_000_000, 32, 1, "IVF64,Flat") == "IVF64,Flat"
    assert parse_bytes("8G") == 8 << 30 and parse_bytes("512M") == 512 << 20 and parse_bytes("1000") == 1000
    with pytest.raises(UserError):
        parse_bytes("lots")


# ---------------------------------------------------------------------------- from a real embed


@pytest.fixture(scope="module")
def emb(run_dir, shapes_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("emb") / "emb"
    cfg = EmbedConfig(run=str(run_dir), data=str(shapes_dir / "train.jsonl"), out=str(out), shard_size=25)
    assert embed_to_shards(cfg)["shards"] == 4
    return out


def test_ivf_folder_answers_an_image_with_itself_and_records_nprobe(emb, tmp_path):
    out = tmp_path / "index"
    cfg = IndexBuildConfig(embeddings=str(emb), out=str(out), dims=[8], factory="IVF8,Flat", recall_target=0.9, tune_queries=50)
    summary = build_index(cfg)
    assert summary["dims"] == [8, 32] and summary["factories"] == {"8": "IVF8,Flat", "32": "IVF8,Flat"}
    contents = load_contents(out)
    tuning = contents.manifest["nprobe_tuning"]["image"]
    for m in ("8", "32"):
        assert contents.manifest["nprobe"][m] == tuning[m]["nprobe"] and 1 <= tuning[m]["nprobe"] <= 8
        assert tuning[m]["recall"] >= 0.9 or tuning[m]["nprobe"] == 8
    assert len(contents.text_rows) == contents.manifest["text_count"] > contents.manifest["count"]
    searcher = Searcher.load(out)
    for row in (0, 30, len(contents.meta) - 1):  # one per shard region, ids across shard offsets
        hit = searcher.search_image([contents.meta[row]["image"]], k=3)[0][0]
        assert hit["id"] == contents.meta[row]["id"]
    for t in (0, len(contents.text_rows) // 2, len(contents.text_rows) - 1):  # caption rows point at their images
        row, c = contents.text_rows[t]
        want = (contents.meta[row]["id"], contents.meta[row]["captions"][c])
        hits = searcher.search_vectors(contents.text_vectors[t : t + 1], k=10, target="text")[0]
        assert want in [(h["id"], h["caption"]) for h in hits]


def test_flat_folder_equals_index_build_from_the_model(emb, run_dir, shapes_dir, tmp_path):
    from_emb = tmp_path / "from_emb"
    build_index(IndexBuildConfig(embeddings=str(emb), out=str(from_emb), dims=[8]))
    direct = tmp_path / "direct"
    build_index(IndexBuildConfig(run=str(run_dir), data=str(shapes_dir / "train.jsonl"), out=str(direct), dims=[8]))
    a, b = load_contents(from_emb), load_contents(direct)
    assert a.manifest["factories"] == {"8": "Flat", "32": "Flat"}
    assert [r["id"] for r in a.meta] == [r["id"] for r in b.meta]
    np.testing.assert_allclose(a.vectors, b.vectors, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(a.text_rows, b.text_rows)
    assert a.manifest["transform"] == b.manifest["transform"]


def test_both_sources_share_one_builder_manifest_and_ivf_policy(emb, run_dir, shapes_dir, tmp_path):
    """--run --data and --embeddings go through the same builder: same manifest keys, same IVF build and
    nprobe tuning, and on-disk lists for either source (the model path used to refuse --on-disk)."""
    common = dict(dims=[8], factory="IVF8,Flat", tune_queries=50, on_disk="always")
    from_emb, direct = tmp_path / "from_emb", tmp_path / "direct"
    build_index(IndexBuildConfig(embeddings=str(emb), out=str(from_emb), **common))
    build_index(IndexBuildConfig(run=str(run_dir), data=str(shapes_dir / "train.jsonl"), out=str(direct), **common))
    a, b = load_contents(from_emb), load_contents(direct)
    assert set(a.manifest) == set(b.manifest)
    assert a.manifest["on_disk"] == b.manifest["on_disk"] and b.manifest["on_disk"]["image"] == {"8": "image.m8.ivfdata", "32": "image.m32.ivfdata"}
    assert a.manifest["nprobe"] == b.manifest["nprobe"] and set(b.manifest["nprobe"]) == {"8", "32"}
    queries = prefix(np.asarray(a.text_vectors[:40]), 8)  # (40, 8)
    np.testing.assert_array_equal(fi.search(a.image_indexes[8], queries, 5)[1], fi.search(b.image_indexes[8], queries, 5)[1])


def test_incomplete_embeddings_are_refused(emb, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(emb, broken)
    shutil.rmtree(broken / "shard-00002")
    with pytest.raises(UserError, match="shards 2 missing"):
        build_index(IndexBuildConfig(embeddings=str(broken), out=str(tmp_path / "index")))
    with pytest.raises(UserError, match="--dims"):
        build_index(IndexBuildConfig(embeddings=str(emb), out=str(tmp_path / "index"), dims=[64]))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, cfg: IndexBuildConfig) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    faiss.omp_set_num_threads(1)
    summary = build_index(cfg)
    assert summary["rank"] == rank and summary["world"] == world


def test_two_gloo_ranks_build_the_same_ivf_folder(emb, tmp_path):
    single, double = tmp_path / "single", tmp_path / "double"
    common = dict(dims=[8], factory="IVF8,Flat", tune_queries=50)
    build_index(IndexBuildConfig(embeddings=str(emb), out=str(single), **common))
    mp.spawn(_rank_main, args=(2, _free_port(), IndexBuildConfig(embeddings=str(emb), out=str(double), **common)), nprocs=2)
    a, b = load_contents(single), load_contents(double)
    assert not list(tmp_path.glob(".*shard-parts"))  # the parts folder is removed after the merge
    assert a.manifest["nprobe"] == b.manifest["nprobe"]
    queries = prefix(a.text_vectors, 8)
    for table in ("image_indexes", "text_indexes"):
        i1 = fi.search(getattr(a, table)[8], queries, 10, fi.SearchParams(nprobe=2))[1]
        i2 = fi.search(getattr(b, table)[8], queries, 10, fi.SearchParams(nprobe=2))[1]
        np.testing.assert_array_equal(i1, i2)


def test_cli_embed_then_index_build_embeddings_then_search_image(run_dir, shapes_dir, tmp_path, capsys):
    """The whole path, small: embed -> index build --embeddings --factory IVF... -> search --image."""
    import json

    from triclip.app.cli import main

    emb, index = tmp_path / "emb", tmp_path / "index"
    data = str(shapes_dir / "train.jsonl")
    assert main(["embed", "--run", str(run_dir), "--data", data, "--out", str(emb), "--shard-size", "30"]) == 0
    capsys.readouterr()
    argv = ["index", "build", "--embeddings", str(emb), "--out", str(index), "--factory", "IVF8,Flat", "--dims", "8"]
    assert main(argv + ["--memory-budget", "1G"]) == 0
    built = json.loads(capsys.readouterr().out)
    assert built["count"] > 80 and built["factories"]["32"] == "IVF8,Flat" and set(built["nprobe"]) == {"8", "32"}
    meta = load_contents(index, indexes=False).meta
    for row in (meta[5], meta[-1]):
        assert main(["search", "--index", str(index), "--image", row["image"], "-k", "3", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)[0]["id"] == row["id"]
    assert main(argv[:2] + ["--run", str(run_dir)] + argv[2:]) == 2  # --embeddings replaces --run / --data
    assert "one or the other" in capsys.readouterr().err
