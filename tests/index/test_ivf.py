"""Inverted lists over codes (``triclip.codecs.ivf``): against exact search, tuned nprobe, ``--add`` without
retraining, lists on disk, and searches from many threads with the serving OpenMP count."""

from __future__ import annotations

import json
import threading

import faiss
import numpy as np
import pytest

from triclip import codecs
from triclip.index.budgets import max_nprobe, overlap, tune_nprobe
from triclip.codecs import ivf
from triclip.index.sources import IndexBuildConfig, build_index
from triclip.index.store import current_version, load_contents
from triclip.index.vectors import exact_topk
from tests.index.conftest import unit_vectors

D = 32


@pytest.fixture(scope="module")
def clustered():
    """3,000 loosely clustered unit vectors (the collection) and 400 queries about the same centres, (n, D) each:
    loose enough that a query's neighbours spread over several of 32 lists."""
    rng = np.random.default_rng(0)
    centres = unit_vectors(rng, 60, D)
    x = centres[rng.integers(0, 60, 3000)] + 1.5 * unit_vectors(rng, 3000, D)
    q = centres[rng.integers(0, 60, 400)] + 1.5 * unit_vectors(rng, 400, D)
    norm = lambda v: (v / np.linalg.norm(v, axis=1, keepdims=True)).astype(np.float32)  # noqa: E731
    return norm(x), norm(q)


def _ivf(inner: str, x: np.ndarray, nlist: int = 32) -> codecs.Codec:
    params = {"inner": inner, "nlist": nlist, "nprobe": 1}
    params.update({"pq": {"M": 8, "nbits": 8}, "opq": {"M": 8, "nbits": 8}, "rq": {"M": 4, "nbits": 8},
                   "pqfs": {"M": 16, "nbits": 4}, "int8": {}}[inner])
    m = 8 if inner == "int8" else D
    codec = codecs.fit(codecs.CodecSpec("ivf", m, 8, params), x)
    codec.add(x)
    return codec


@pytest.mark.parametrize("inner", ["pq", "opq", "rq", "int8", "pqfs"])
def test_every_list_scanned_is_the_flat_scan_of_the_same_codes(clustered, inner):
    """At nprobe = nlist the lists answer as a flat index of their decoded vectors: the same ids and scores (fast
    scan: its 8-bit tables' estimates, the same top 10 but for near ties)."""
    x, q = clustered
    codec = _ivf(inner, x)
    flat = faiss.IndexFlatIP(D)
    flat.add(codec.reconstruct())
    scores, ids = codec.search(q, 10, params=codec.exhaustive())
    exact_scores, exact_ids = flat.search(q, 10)
    if codec.spec.params["inner"] == "pqfs":
        assert overlap(ids, exact_ids) >= 0.95 and np.abs(scores - exact_scores).max() < 0.02
    else:
        assert overlap(ids, exact_ids) >= 0.999
        np.testing.assert_allclose(scores, exact_scores, atol=1e-5)
    assert overlap(codec.search(q, 10, params={"nprobe": 1})[1], ids) < 0.9  # one list of 32 is not all of them


@pytest.mark.parametrize("inner", ["pq", "pqfs"])
def test_the_tuned_nprobe_keeps_the_target_on_held_out_queries(clustered, inner):
    """nprobe tuned on 200 queries (the smallest power of two keeping 80% of the exhaustive top 10, within a
    quarter of the lists) keeps 80% on 200 others; and the exhaustive answers are close to exact float32 search
    for the 8-byte codes."""
    x, q = clustered
    codec = _ivf(inner, x)
    nprobe, kept = tune_nprobe(codec, q[:200], 0.8)
    assert kept >= 0.8 and 1 < nprobe <= max_nprobe(32) == 8
    assert overlap(codec.search(q[:200], 10, params={"nprobe": nprobe // 2})[1],
                   codec.search(q[:200], 10, params=codec.exhaustive())[1]) < 0.8  # the smallest that does
    held_out = q[200:]
    whole = codec.search(held_out, 10, params=codec.exhaustive())[1]
    assert overlap(codec.search(held_out, 10, params={"nprobe": nprobe})[1], whole) >= 0.8
    assert overlap(whole, exact_topk(x, held_out, 10)) >= 0.5  # and the codes themselves find the exact neighbours


def test_nlist_follows_n_and_no_lists_below_the_threshold():
    assert ivf.lists_for(10**6) == 4096 and ivf.lists_for(10**5) == 1024 and ivf.lists_for(10) == ivf.MIN_LISTS
    assert ivf.lists_for(10**12) == ivf.MAX_LISTS
    assert not [s for s in codecs.candidates(16, 256, ivf.IVF_MIN_N - 1) if s.codec in ("ivf", "binary_ivf")]
    specs = [s for s in codecs.candidates(16, 256, 10**6) if s.codec in ("ivf", "binary_ivf")]
    assert {s.params.get("inner") for s in specs} == set(ivf.INNER) | {None}
    assert all(s.params["nlist"] == 4096 and s.bytes_per_vector <= 16 for s in specs)


def test_a_fit_on_few_vectors_takes_fewer_lists(clustered):
    x, _ = clustered
    codec = codecs.fit(codecs.CodecSpec("ivf", D, 8, {"inner": "pqfs", "M": 16, "nbits": 4, "nlist": 4096,
                                                      "nprobe": 64}), x[:780])
    assert codec.spec.params["nlist"] == 780 // ivf.TRAIN_PER_LIST == codec.ivf.nlist
    assert codec.spec.params["nprobe"] == 20  # at most nlist


@pytest.fixture
def ivf_only(monkeypatch, given_latency):
    """Inverted lists offered at any size (the shapes data has ~90 images), over PQ codes only (on disk: lists
    FAISS can map), latencies given."""
    monkeypatch.setattr(ivf, "IVF_MIN_N", 1)
    monkeypatch.setattr(ivf, "INNER", ("pq",))
    return given_latency


def test_add_appends_to_the_lists_without_retraining(run_dir, shapes_dir, tmp_path, ivf_only):
    from tests.index.conftest import split_manifest

    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    split_manifest(shapes_dir / "train.jsonl", first, second, 60)
    out = tmp_path / "index"
    build_index(IndexBuildConfig(run=str(run_dir), data=str(first), out=str(out), bytes=[8], codec="ivf",
                                 on_disk="never"))
    before = load_contents(out)
    build_index(IndexBuildConfig(run=str(run_dir), data=str(second), out=str(out), add=True))
    after = load_contents(out)
    old, new = before.codes[8], after.codes[8]
    assert new.spec.codec == "ivf" and len(new) == after.manifest["count"] > len(old)
    assert after.manifest["budgets"]["8"]["spec"] == before.manifest["budgets"]["8"]["spec"]  # nlist, nprobe kept
    assert new.spec.params["nlist"] == old.spec.params["nlist"] and new.spec.params["nprobe"] == old.spec.params["nprobe"]
    np.testing.assert_array_equal(new.reconstruct(np.arange(len(old))), old.reconstruct())  # old rows: same codes
    centroids = lambda c: c.ivf.quantizer.reconstruct_n(0, c.ivf.nlist)  # noqa: E731
    np.testing.assert_array_equal(centroids(new), centroids(old))  # the coarse k-means, not trained again
    fresh = old.empty_copy()
    fresh.add(np.asarray(after.vectors))
    np.testing.assert_array_equal(new.reconstruct(), fresh.reconstruct())  # new rows: encoded by the same code


def test_lists_on_disk_answer_as_in_memory(run_dir, shapes_dir, tmp_path, ivf_only):
    """Lists beyond ``--memory-budget``: the budget's lists are a memory-mapped file of the version, the manifest
    names it, and searches (codes alone, and through the Searcher with its stages) equal those of the same build
    in memory (``--on-disk never``); --add is refused."""
    from triclip.core.errors import UserError
    from triclip.index.search import Searcher

    built = {}
    for mode, memory in (("auto", 1000), ("never", None)):  # 90 images' lists: 90 x (8 + 8) bytes > 1000
        out = tmp_path / mode
        build_index(IndexBuildConfig(run=str(run_dir), data=str(shapes_dir / "train.jsonl"), out=str(out),
                                     bytes=[8], codec="ivf", on_disk=mode, memory_budget=memory, factory="Flat"))
        built["always" if mode == "auto" else mode] = out
    folder = built["always"] / current_version(built["always"])
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["budgets"]["8"]["lists"] == "image.b8.codec.ivfdata" and (folder / "image.b8.codec.ivfdata").is_file()
    assert manifest["budgets"]["8"]["text"]["lists"] == "text.b8.codec.ivfdata"
    assert "lists" not in json.loads((built["never"] / current_version(built["never"]) / "manifest.json").read_text())[
        "budgets"]["8"]
    disk, memory = Searcher.load(built["always"]), Searcher.load(built["never"])
    assert disk.contents.codes[8].on_disk() and not memory.contents.codes[8].on_disk()
    queries = np.asarray(memory.contents.text_vectors[:30])
    for rescore in (None, "none", "float"):
        assert disk.search_vectors(queries, k=5, bytes=8, rescore=rescore) == \
            memory.search_vectors(queries, k=5, bytes=8, rescore=rescore)
    np.testing.assert_array_equal(disk.contents.codes[8].reconstruct(), memory.contents.codes[8].reconstruct())
    with pytest.raises(UserError, match="lists on disk"):
        build_index(IndexBuildConfig(run=str(run_dir), data=str(shapes_dir / "val.jsonl"), out=str(built["always"]),
                                     add=True))


def test_twenty_threads_search_a_budget_as_one_thread_does_with_the_serving_thread_count(run_dir, shapes_dir,
                                                                                          tmp_path, given_latency):
    """OpenMP's thread count is per thread: each of 20 threads searching the codes of a budget at once runs with
    the configured count (read back inside each thread after its search), and gets one thread's answers."""
    from triclip.index.search import Searcher
    from triclip.codecs.threads import search_threads, set_search_threads

    out = tmp_path / "index"
    build_index(IndexBuildConfig(run=str(run_dir), data=str(shapes_dir / "train.jsonl"), out=str(out), bytes=[8]))
    searcher = Searcher.load(out)
    queries = np.asarray(searcher.contents.text_vectors[:40])
    expected = [searcher.search_vectors(queries[i : i + 1], k=5, bytes=8) for i in range(len(queries))]
    default = faiss.omp_get_max_threads()
    configured = 1 if default != 1 else 2  # differs from the count a new thread starts with
    seen, answers, errors = {}, {}, []
    start = threading.Barrier(20)

    def worker(w: int) -> None:
        try:
            start.wait()
            for i in range(w, len(queries), 20):
                answers[i] = searcher.search_vectors(queries[i : i + 1], k=5, bytes=8)
            seen[w] = faiss.omp_get_max_threads()
        except Exception as err:  # noqa: BLE001 (reported below)
            errors.append(err)

    try:
        set_search_threads(configured)
        threads = [threading.Thread(target=worker, args=(w,)) for w in range(20)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert search_threads() == configured
    finally:
        set_search_threads(None)
    assert not errors
    assert seen == {w: configured for w in range(20)}
    assert [answers[i] for i in range(len(queries))] == expected


def test_the_fast_single_query_rerank_is_the_batched_one():
    """:func:`rerank` of one query takes a shorter path: the same scores and ids (missing candidates too)."""
    from triclip.index.search import rerank

    rng = np.random.default_rng(0)
    vectors = unit_vectors(rng, 500, D)
    queries = unit_vectors(rng, 6, D)
    candidates = rng.integers(-1, 500, (6, 40))  # some -1: missing
    candidates[5, 3:] = -1  # fewer than k found
    batched = rerank(vectors, queries, candidates, 10)
    for i in range(6):
        one = rerank(vectors, queries[i : i + 1], candidates[i : i + 1], 10)
        np.testing.assert_array_equal(one[1], batched[1][i : i + 1])
        np.testing.assert_allclose(one[0], batched[0][i : i + 1], rtol=1e-6)
    assert (batched[1][5, 3:] == -1).all()
