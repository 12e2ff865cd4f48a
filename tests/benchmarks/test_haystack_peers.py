"""benchmarks.haystack_peers and scripts/peer_worker.py: the sizing rules and the table, then each peer built and
measured through the worker in a process of its own on a small clustered haystack (real FAISS; autofaiss and
usearch in the peers' environment when it exists), its answers compared with exact search."""

import json
import os
import sys

import numpy as np
import pytest

from benchmarks import haystack_peers as hp

sys.path.insert(0, str(hp.WORKER.parent))
import peer_worker as worker  # noqa: E402  (scripts/ is no package: the worker runs by path in either environment)
from tests.index.conftest import run_dir, shapes_dir  # noqa: E402,F401 (the fixtures of a tiny trained run)
from tests.index.test_from_embeddings import emb  # noqa: E402,F401

PEERS_PYTHON = os.path.join(hp.PeersConfig.venv, "bin", "python")
NEEDS_VENV = pytest.mark.skipif(not os.path.isfile(PEERS_PYTHON), reason=(
    f"the peers' environment ({', '.join(hp.VENV_PACKAGES)}) is not at {hp.PeersConfig.venv}; "
    "`python -m benchmarks.haystack_peers` makes it (pip, network or a local index needed)"))


def test_usearch_dtype_matches_bytes_per_vector():
    assert hp.usearch_dtype(32, 256) == "b1"  # 256 bits
    assert hp.usearch_dtype(256, 256) == "i8"
    assert hp.usearch_dtype(512, 256) == "f16"
    assert hp.usearch_dtype(16, 256) is None  # no dtype takes 16 B at D = 256


def test_memory_cap_nlist_and_folders():
    assert hp.memory_cap(4, 1_000_000) == 12_000_000  # 4 B codes + 8 B ids
    assert hp.memory_cap(4, 1_000_000, triclip_ram=20_000_000) == 20_000_000
    assert (hp.nlist_for(1_000_000), hp.nlist_for(100_000), hp.nlist_for(100)) == (1024, 256, 16)
    assert hp.triclip_dir([8, 16]) == "triclip-b8-16" != hp.triclip_dir([4, 32])
    assert hp.triclip_dir([8, 16], "Flat") == "triclip-b8-16-flat"  # another float index: another build
    assert hp.parse(["I", "--data", "D", "--work", "W", "--factory", "Flat"]).factory == "Flat"
    assert hp.parse(["I", "--data", "D", "--work", "W"]).factory == "auto"
    assert hp.triclip_dir([8], "Flat", 16_000_000) == "triclip-b8-flat-mem16000000"  # within a memory budget
    assert hp.triclip_dir([8], latency_ms=50) == "triclip-b8-50ms" and hp.bound_suffix(10.0) == ""
    assert hp.triclip_dir([8], vectors="sq8") == "triclip-b8-sq8"  # rows kept in another precision: another build
    assert hp.parse(["I", "--data", "D", "--work", "W", "--equal-memory"]).equal_memory
    assert not hp.parse(["I", "--data", "D", "--work", "W"]).equal_memory


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="Linux's per-process I/O counters")
def test_cold_queries_are_searched_once_then_timed_with_the_index_files_evicted(tmp_path):
    """Each query timed cold is searched once untimed (its reads settled), then reads the index's files from storage
    again (the folder's files evicted before it)."""
    from tests.index.test_diskrows import read_bytes
    (tmp_path / "sub").mkdir()
    for name in ("a.npy", "sub/b.npy"):
        np.save(tmp_path / name, np.ones((1000, 256), np.float32))
    size = sum((tmp_path / name).stat().st_size for name in ("a.npy", "sub/b.npy"))
    read = []

    def search(q, threads):
        before = read_bytes()
        [np.load(tmp_path / name) for name in ("a.npy", "sub/b.npy")]
        read.append(read_bytes() - before)
    search(None, 1)
    read.clear()
    ms = worker.cold_query_ms(search, np.zeros((3, 4), np.float32), str(tmp_path))
    assert len(ms) == 3 and len(read) == 6  # each query: once to settle, once timed
    assert all(got >= size - 8192 for got in read[1::2])  # the timed ones read from storage


def test_table_averages_seeds_and_shows_errors():
    recs = [{"seed": s, "budget": 8, "method": "faiss", "label": "IVF", "recall@10": r, "code_bytes": 8}
            for s, r in ((0, 0.2), (1, 0.4))]
    recs.append({"seed": 0, "budget": 8, "method": "autofaiss", "error": "no index fits"})
    lines = hp.table(recs).splitlines()
    faiss_row = next(line for line in lines if "| faiss |" in line)
    assert "0.300 ± 0.141" in faiss_row and "| 2 |" in faiss_row and "| 8 |" in faiss_row
    auto_row = next(line for line in lines if "| autofaiss |" in line)
    assert "no index fits" in auto_row and "| 0 |" in auto_row and "–" in auto_row
    assert hp.cell([0.25], 1, 3) == "0.250"


def test_worker_pieces():
    x = np.array([[0.5, -0.1, 0.2, -0.3, 0.1, 0.1, -0.2, 0.4]], np.float32)
    assert worker.usearch_rows(x, "b1").tolist() == [[0b10101101]]
    parts = [np.arange(i * 10, i * 10 + 10, dtype=np.float32)[:, None] * np.ones((1, 2), np.float32) for i in range(3)]
    got = worker.sample_rows(parts, 12, seed=1)
    assert got.shape == (12, 2) and len(set(got[:, 0].tolist())) == 12 and set(got[:, 0].tolist()) <= set(range(30))
    assert worker.sample_rows(parts, 99).shape == (30, 2)  # at most every row


# ---------------------------------------------------------------------------- a small haystack, every method


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """6,000 clustered rows (D = 32) in 3 parts; test and val queries are noisy copies of distinct rows."""
    root = tmp_path_factory.mktemp("haystack")
    rng = np.random.default_rng(0)
    rows = rng.normal(size=(60, 32))[rng.integers(0, 60, 6000)] + 0.6 * rng.normal(size=(6000, 32))
    rows = (rows / np.linalg.norm(rows, axis=1, keepdims=True)).astype(np.float32)
    (root / "npy").mkdir()
    for i in range(3):
        np.save(root / "npy" / f"{i:04d}.npy", rows[i * 2000:(i + 1) * 2000])
    targets = rng.choice(6000, 200, replace=False)
    queries = (rows[targets] + 0.08 * rng.normal(size=(200, 32))).astype(np.float32)
    truth = np.argsort(-queries @ rows.T, axis=1)[:, :10]
    for name, part in (("queries", queries[:100]), ("truth", truth[:100]), ("val", queries[100:]),
                       ("val_truth", truth[100:])):
        np.save(root / f"{name}.npy", part)
    h = hp.Haystack(root, root / "npy", root / "queries.npy", [{int(t)} for t in targets[:100]], root / "val.npy",
                    truth[:100], root / "val_truth.npy")
    return h, rows


def measured(h, method: str, budget: int, python: str) -> dict:
    cfg = hp.PeersConfig("", "", str(h.root), n=6000, methods=[method], cores=2, latency_ms=10)
    (rec,) = hp.run_budget(cfg, h, 0, budget, {}, {method: python})
    assert "error" not in rec, rec
    return rec


def test_plain_faiss_is_tuned_to_the_target_and_holds_it_on_the_test_queries(small):
    h, rows = small
    rec = measured(h, "faiss", 8, sys.executable)
    params = json.loads((h.root / "faiss-b8" / "params.json").read_text())
    assert params["held_on_val"] >= hp.TARGET and rec["nprobe"] == params["nprobe"]
    assert rec["of_exact_top10"] >= 0.9  # tuned on the val queries, checked on the test queries against exact search
    assert rec["recall@10"] >= 0.9 and rec["code_bytes"] == 8
    assert rec["rss_bytes"] > rows.nbytes // 2  # IndexRefineFlat holds the float rows
    assert rec["p50_ms_1t"] <= rec["p99_ms_1t"] and rec["batch_qps_2t"] > 0
    index_bytes = (h.root / "faiss-b8" / "index.faiss").stat().st_size  # + its params and spec
    assert index_bytes < rec["disk_bytes"] < index_bytes + 10_000
    again = measured(h, "faiss", 8, sys.executable)  # built once: the build record is reused
    assert again["build_s"] == rec["build_s"]


def test_a_faiss_pair_that_cannot_reach_the_target_is_the_last_tried(small):
    h, rows = small
    import faiss
    base = faiss.index_factory(32, "IVF16,PQ4x4fs", faiss.METRIC_INNER_PRODUCT)
    base.train(rows)
    index = faiss.IndexRefineFlat(base)
    index.add(rows)
    truth = np.argsort(-rows[:20] @ rows.T, axis=1)[:, :10]
    assert worker.faiss_tune(index, rows[:20], truth, 1.01) == {"nprobe": 16, "k_factor": 512, "held_on_val": 1.0}


@NEEDS_VENV
def test_usearch_b1_against_exact_hamming(small):
    h, rows = small
    rec = measured(h, "usearch", 4, PEERS_PYTHON)  # b1 at D = 32: 4 B
    ids = np.load(h.root / "usearch-b4" / "ids.npy")
    bits = np.unpackbits(worker.usearch_rows(rows, "b1"), axis=1).astype(np.int32)
    q = np.unpackbits(worker.usearch_rows(np.load(h.queries), "b1"), axis=1).astype(np.int32)
    hamming = (q[:, None, :] != bits[None, :, :]).sum(-1)  # (Q, N)
    tenth = np.sort(hamming, axis=1)[:, 9]
    within = np.mean([(hamming[i, ids[i]] <= tenth[i]).mean() for i in range(len(q))])
    assert within >= 0.9  # HNSW's top 10 are (ties included) the exact Hamming top 10
    assert rec["code_bytes"] == 4 and rec["usearch"] == "2.26.6"


@NEEDS_VENV
def test_autofaiss_against_exact_search(small):
    h, _ = small
    rec = measured(h, "autofaiss", 16, PEERS_PYTHON)
    assert rec["autofaiss"] == "2.18.0" and rec["faiss"] == "1.8.0" and rec["label"]
    assert rec["of_exact_top10"] >= 0.9  # (at 6,000 rows it takes HNSW over float rows, past the 24 B cap)
    assert rec["code_bytes"] * 6000 <= rec["disk_bytes"]  # bytes per vector: the index's own


@pytest.mark.parametrize("kept", [{}, {"vectors": "sq8", "memory_budget": 20_000}])  # sq8 rows re-ranked from disk
def test_triclip_is_measured_cold_with_and_without_the_hits_meta_rows_and_both_answer_the_same_rows(emb, tmp_path, kept):  # noqa: F811
    """The worker's triclip search maps each hit's meta id back to its row; its ``rows`` search returns the rows
    the codes rank, without reading the meta: the same answers, and ``measure`` times both cold (the rows a
    re-rank reads from disk dropped from the process's map before each query, sq8 codes' too)."""
    from triclip.index.sources import IndexBuildConfig, build_index
    from triclip.index.store import load_contents

    out = tmp_path / "index"
    build_index(IndexBuildConfig(embeddings=str(emb), out=str(out), dims=[8], bytes=[8], factory="Flat", **kept))
    if kept:  # a re-rank of 40 sq8 rows read from disk, whatever the build kept on these few rows
        from triclip.index.store import MANIFEST, current_version

        file = out / current_version(out) / MANIFEST
        manifest = json.loads(file.read_text())
        manifest["budgets"]["8"]["rescore"] = {"with": "float", "shortlist": 40, "shortlist_how": "measured",
                                               "disk_bytes_per_query": 0, "reads": "disk"}
        file.write_text(json.dumps(manifest))
    queries = np.asarray(load_contents(str(out), indexes=False).text_vectors[:30], np.float32)  # (30, D)
    np.save(tmp_path / "queries.npy", queries)
    search = worker.triclip_load({"dir": str(out), "bytes": 8})
    rows = search(queries, 1)
    assert rows.shape == (30, 10) and (rows >= 0).all() and np.array_equal(search.rows(queries, 1), rows)
    spec = {"method": "triclip", "dir": str(out), "bytes": 8, "queries": str(tmp_path / "queries.npy"),
            "ids": str(tmp_path / "ids.npy"), "times": str(tmp_path / "query_ms.npz")}
    got = worker.measure(spec)
    assert got["p50_ms_cold_rows"] > 0 and got["p99_ms_cold_rows"] >= got["p50_ms_cold_rows"]
    each = np.load(spec["times"])  # each query's cold ms, which the percentiles summarise
    assert sorted(each.files) == ["cold", "cold_rows"] and each["cold"].shape == (30,)
    assert np.percentile(each["cold_rows"], 99) == pytest.approx(got["p99_ms_cold_rows"], abs=1e-3)
    assert np.array_equal(np.load(spec["ids"]), rows)


@pytest.mark.parametrize("inner", ["opq", "int8"])  # with and without a rotation before the lists
def test_tail_queries_counts_the_codes_each_query_scans_as_the_lists_ranks_say(inner):
    """scripts/tail_queries.py's codes scanned per query is the count of stored vectors whose list ranks below
    nprobe for that query (``IVFCodec.list_ranks``), and FAISS scans that many at that nprobe."""
    import tail_queries
    from tests.index.test_ivf import _ivf, clustered  # noqa: F401
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3000, 32)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    codec = _ivf(inner, x)
    codec.set_nprobe(4)
    q = x[:20] + 0.1 * rng.standard_normal((20, 32)).astype(np.float32)  # (20, D)
    ranks, lists = codec.list_ranks(q)
    want = (ranks[:, lists] < 4).sum(axis=1)  # (20,)
    assert np.array_equal(tail_queries.codes_scanned(codec, q), want) and want.min() > 0
    assert len(set(want.tolist())) > 1  # lists of different sizes: the count is each query's own
    import faiss
    stats = faiss.cvar.indexIVF_stats
    stats.reset()
    codec.search(q[:1], 10)
    assert stats.ndis == want[0]  # what FAISS itself counts as scanned


def test_a_haystack_whose_rows_were_deleted_is_drawn_again_and_the_rest_of_its_folder_kept(tmp_path):
    """Deleting a seed's rows (``embeddings``: 10 GB at 10M) and its links for the disk, then running again, draws
    the same rows from the seed into the same folder and keeps what else it holds (logs, peers' indexes)."""
    from tests.benchmarks.test_haystack import collection
    sp = collection()
    cfg = hp.PeersConfig(index="INDEX", data="DATA", work=str(tmp_path), n=250, text_codes=False)
    first = hp.haystack_of(cfg, 3, sp)
    rows = [np.load(p) for p in sorted(first.npy.glob("*.npy"))]
    (first.root / "build.log").write_text("kept")
    import shutil
    shutil.rmtree(first.root / "embeddings")
    shutil.rmtree(first.npy)
    again = hp.haystack_of(cfg, 3, sp)
    assert (again.root / "build.log").read_text() == "kept" and (again.root / "embeddings" / "manifest.json").is_file()
    redrawn = [np.load(p) for p in sorted(again.npy.glob("*.npy"))]
    assert len(redrawn) == len(rows) > 0 and all(np.array_equal(a, b) for a, b in zip(rows, redrawn))
    assert np.array_equal(again.truth, first.truth) and not list(tmp_path.glob(".*"))  # no staging folder left
