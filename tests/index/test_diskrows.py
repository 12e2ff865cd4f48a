"""A re-rank that reads its float vectors from disk (``triclip.index.diskrows``): the rows gathered are the file's,
the choice charges their cold reads and offers shorter shortlists, a build beyond its memory budget records it,
and the search reads them so. Latencies come from an injected model (``GivenLatency``): nothing is timed here."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from triclip.index import budgets as bud
from triclip.index.budgets import EvalSet, Rules, choose
from triclip.index.report import table
from triclip.index.diskrows import GATHER_MIN, DiskRows, cold_read_ms, evict, settle
from triclip.index.search import Searcher, rerank, rerank_from
from triclip.index.sources import IndexBuildConfig, build_index
from triclip.index.store import current_version
from tests.index.conftest import GivenLatency
from tests.index.test_from_embeddings import emb  # noqa: F401 (the same fixture)
from tests.index.test_ivf import clustered  # noqa: F401 (the same fixture)


def test_disk_rows_are_the_files_rows_for_any_shape_of_ids_and_rerank_the_same(tmp_path):
    """Gathered in one thread (few ids) or many, for ids of shape (R,) or (q, C), cold or cached: the rows the
    array holds; a re-rank from them equals the re-rank from the array; an array in memory has no DiskRows."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3000, 16)).astype(np.float32)
    np.save(tmp_path / "v.npy", x)
    mapped = np.load(tmp_path / "v.npy", mmap_mode="r")
    rows = DiskRows.of(mapped)
    assert DiskRows.of(x) is None and len(rows) == 3000 and rows.shape == x.shape
    for ids in (rng.integers(0, 3000, GATHER_MIN - 1), rng.integers(0, 3000, 5 * GATHER_MIN),
                rng.integers(0, 3000, (4, 200))):
        evict(tmp_path / "v.npy")
        np.testing.assert_array_equal(rows[ids], x[ids])
        np.testing.assert_array_equal(rows[ids], x[ids])  # now from the page cache
    queries, candidates = x[:20] + 0.1, rng.integers(-1, 3000, (20, 300))
    for q, c in ((queries, candidates), (queries[:1], candidates[:1])):
        for got, want in zip(rerank_from(rows, q, c, 10), rerank(x, q, c, 10)):
            np.testing.assert_array_equal(got, want)


def test_every_rows_read_is_requested_before_any_row_is_gathered(tmp_path, monkeypatch):
    """A gather of R > 1 rows first asks the kernel for each row's bytes (``POSIX_FADV_WILLNEED``: the reads start
    together), then copies them, by one thread or many: the rows are the file's either way."""
    x = np.arange(3000 * 16, dtype=np.float32).reshape(3000, 16)
    np.save(tmp_path / "v.npy", x)
    rows = DiskRows(tmp_path / "v.npy")
    events = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, start, length, how: events.append(("ask", start, length, how)),
                        raising=False)  # fmt: skip
    gather = rows.gather
    monkeypatch.setattr(rows, "gather", lambda ids, threads=None: events.append(("gather",)) or gather(ids, threads))
    offset = np.load(tmp_path / "v.npy", mmap_mode="r").offset
    ids = np.array([[7, 2999], [0, -1]])
    np.testing.assert_array_equal(rows[ids], x[ids])
    want = [("ask", offset + 64 * i, 64, os.POSIX_FADV_WILLNEED) for i in (7, 2999, 0, 2999)]
    assert events == [*want, ("gather",)]
    events.clear()
    np.testing.assert_array_equal(rows[[5]], x[[5]])
    assert events == [("gather",)]  # one row: nothing to overlap
    many = np.arange(2 * GATHER_MIN) % 3000
    for threads in (None, 1, 7):
        np.testing.assert_array_equal(rows.gather(many, threads), x[many])


def read_bytes() -> int:
    """Bytes this process has had read from storage (``/proc/self/io``): page-cache hits do not count."""
    with open("/proc/self/io") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("read_bytes:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="Linux's per-process I/O counters")
def test_an_evicted_file_is_read_from_disk_again_and_a_cached_one_is_not(tmp_path):
    file = tmp_path / "v.npy"
    np.save(file, np.ones((2000, 256), np.float32))  # 2 MB
    size = file.stat().st_size
    file.read_bytes()
    before = read_bytes()
    file.read_bytes()
    cached = read_bytes() - before
    evict(file)
    before = read_bytes()
    file.read_bytes()
    assert cached < size // 10 and read_bytes() - before >= size - 4096
    rows = DiskRows(file)
    rows[np.arange(2000)]  # every page mapped by this DiskRows
    evict(file)
    before = read_bytes()
    file.read_bytes()
    assert read_bytes() - before < size // 10  # a mapped page stays in the page cache
    rows.drop_pages()
    evict(file)
    before = read_bytes()
    file.read_bytes()
    assert read_bytes() - before >= size - 4096
    np.testing.assert_array_equal(rows[np.arange(5)], np.ones((5, 256), np.float32))  # still readable


@pytest.fixture
def scaled(clustered):  # noqa: F811
    x, q = clustered
    evaluation = EvalSet.of(x[:300], q[:150], np.argmax(q[:150] @ x[:300].T, axis=1), [f"t{i}" for i in range(150)],
                            "validation", "synthetic")
    return x, evaluation


def test_a_rerank_from_disk_is_charged_its_cold_reads_and_shorter_shortlists_are_offered(scaled):
    """With the vectors on disk (``Rules.reads_from``) every re-ranked variant's latency is its first stage plus the
    cold reads of its shortlist at N (asked of the model, for that file and count), every shortlist length tried on
    the way to the target is a variant (ascending, holding ever more of the exact top 10); in memory, one variant
    per code and no read is charged. Under a bound the longest shortlists exceed, a shorter one within it is kept
    when it ranks best there."""
    x, evaluation = scaled
    model = GivenLatency(reference=1.0, per_read=1e-4)
    memory = choose(8, x, evaluation, force="pq", rules=Rules(n=1_000_000, recall_target=0.9, model=model))
    assert model.reads == []
    staged = [t for t in memory.tried if t["shortlist"]]
    assert staged and len({t["label"] for t in staged}) == len(staged) and {t["reads"] for t in staged} == {"memory"}
    disk = choose(8, x, evaluation, force="pq", rules=Rules(
        n=1_000_000, recall_target=0.9, model=model, reads_from="v.npy", latency_ms=1.0))
    staged = [t for t in disk.tried if t["shortlist"]]
    by_label = {}
    for t in staged:
        by_label.setdefault(t["label"], []).append(t)
        alone = next(a for a in disk.tried if a["label"] == t["label"] and not a["shortlist"])
        assert t["reads"] == "disk" and t["latency_ms"] == pytest.approx(alone["latency_ms"] + 1e-4 * t["shortlist"])
        assert ("v.npy", t["shortlist"]) in model.reads
    assert max(len(v) for v in by_label.values()) >= 2
    for variants in by_label.values():
        lengths = [t["shortlist"] for t in variants]
        assert lengths == sorted(lengths) and len(set(lengths)) == len(lengths)
        assert [t["fidelity"] for t in variants] == sorted(t["fidelity"] for t in variants)
    far = choose(8, x, evaluation, force="pq", rules=Rules(n=1_000_000, recall_target=0.999, model=model,
                                                           reads_from="v.npy", latency_ms=1.0))
    capped = [t["shortlist"] for t in far.tried if t["shortlist"]]  # lists past SHORTLIST_MAX at N: read once
    assert max(capped) == bud.SHORTLIST_MAX and len(set(capped)) == len(capped)
    within = [t for t in disk.tried if t["recall"] is not None and t["latency_ms"] <= 1.0]
    assert any(t["latency_ms"] > 1.0 for t in staged) and disk.kept.shortlist and disk.kept.latency.ms <= 1.0
    best = max((min(t["fidelity"], 0.9), -t["bytes"], -t["latency_ms"]) for t in within)
    kept = disk.kept.entry(x.shape[1])
    assert (min(kept["fidelity"], 0.9), -kept["bytes"], -kept["latency_ms"]) == best


def test_a_build_beyond_its_memory_budget_charges_cold_reads_and_its_search_reads_them_from_disk(emb, tmp_path,  # noqa: F811
                                                                                                  given_latency):
    """``index build --embeddings`` whose float vectors exceed ``--memory-budget`` has the choice time cold reads of
    its own vectors file and records every re-ranked candidate as reading from disk; within the budget, none. A
    budget whose stage reads from disk is searched through a DiskRows of the version's vectors, with the answers of
    the same stage read from memory."""
    given_latency.per_read = 1e-6
    built = {}
    for name, memory in (("disk", 1024), ("memory", 1 << 30)):
        out = tmp_path / name
        given_latency.reads = []
        summary = build_index(IndexBuildConfig(embeddings=str(emb), out=str(out), bytes=[8], factory="Flat",
                                               memory_budget=memory))
        assert ("(cold)" in table(summary["budgets"])) == (name == "disk")  # the re-ranked candidates' lines
        folder = out / current_version(out)
        curves = json.loads((folder / "curves.json").read_text())
        staged = [t for t in curves["bytes"]["candidates"]["8"] if t.get("shortlist")]
        assert staged and {t["reads"] for t in staged} == {name}
        assert bool(given_latency.reads) == (name == "disk")
        assert all(f.endswith("vectors.npy") for f, _ in given_latency.reads)
        built[name] = out
    searcher = Searcher.load(built["disk"])
    queries = np.asarray(searcher.contents.text_vectors[:25])
    stage = {"with": "float", "shortlist": 40, "shortlist_how": "measured", "disk_bytes_per_query": 0}
    answers = {}
    for reads in ("memory", "disk"):
        searcher.contents.manifest["budgets"]["8"]["rescore"] = {**stage, "reads": reads}
        answers[reads] = searcher.search_vectors(queries, k=5, bytes=8)
        assert bool(searcher._rows_on_disk) == (reads == "disk")
    assert answers["disk"] == answers["memory"]
    assert isinstance(next(iter(searcher._rows_on_disk.values())), DiskRows)


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="Linux's per-process I/O counters")
def test_an_end_to_end_cold_search_reads_each_querys_shortlist_from_disk(tmp_path, monkeypatch):
    """``LatencyModel.cold_search`` (what the choice charges a re-rank from disk at N): each timed query asks the
    codes for the shortlist's length and gathers those rows from the file, evicted first, so they come from disk."""
    from triclip.codecs import CodecSpec, fit
    from triclip.index import latency

    rng = np.random.default_rng(0)
    x = rng.standard_normal((4000, 256)).astype(np.float32)  # 1 KB a row: a page holds 4
    np.save(tmp_path / "v.npy", x)
    codes = fit(CodecSpec("pq", 256, 8, {"M": 8, "nbits": 4}), x)
    codes.add(x)
    asked, search = [], codes.search
    codes.search = lambda q, k, params=None: (asked.append(k), search(q, k, params=params))[1]
    before = read_bytes()
    ms = latency.LatencyModel().cold_search(codes, str(tmp_path / "v.npy"), x[:5] + 0.1, 200)
    assert ms > 0 and asked == [200] * (2 * latency.COLD_QUERIES + 1)  # the warm-up; each timed one settled first
    assert read_bytes() - before >= 2 * latency.COLD_QUERIES * 100 * 4096  # 200 rows of 1,000 pages: ~180 pages,
    # read to settle them and again, cold


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="Linux's per-process I/O counters")
def test_settled_rows_were_read_once_and_are_read_from_disk_again(tmp_path):
    """``settle`` (what a cold timing starts from): the rows are read from storage, then out of the page cache and
    out of the map, so the timed gather reads them from storage again."""
    x = np.random.default_rng(0).standard_normal((4000, 256)).astype(np.float32)  # 1 KB a row
    np.save(tmp_path / "v.npy", x)
    rows, ids = DiskRows(tmp_path / "v.npy"), np.arange(0, 4000, 8)  # one row in every other page: 500 pages
    evict(tmp_path / "v.npy")
    before = read_bytes()
    settle(rows, ids)
    settled = read_bytes() - before
    before = read_bytes()
    np.testing.assert_array_equal(rows[ids], x[ids])
    assert settled >= 500 * 4096 and read_bytes() - before >= 500 * 4096
    before = read_bytes()
    rows[ids]
    assert read_bytes() - before < 50 * 4096  # the control: cached now, nothing read


def test_each_cold_timing_draws_rows_never_drawn_before_and_settles_them_first(tmp_path, monkeypatch):
    """``cold_read_ms`` draws new rows at every draw and every call (a row read once comes back faster from a VM
    host's cache), reads each draw to settle it, then times the same rows."""
    from triclip.index import diskrows

    np.save(tmp_path / "v.npy", np.zeros((100_000, 4), np.float32))
    seen, settled = [], []
    monkeypatch.setattr(diskrows, "settle", lambda rows, ids: settled.append(ids.copy()))
    monkeypatch.setattr(DiskRows, "__getitem__", lambda self, ids: seen.append(np.asarray(ids).copy()))
    for _ in range(2):
        assert cold_read_ms(tmp_path / "v.npy", 50, reps=3) >= 0
    assert len(seen) == len(settled) == 6
    assert all(np.array_equal(a, b) for a, b in zip(seen, settled))  # each timed draw is the one settled
    assert len(np.unique(np.concatenate(seen))) > 0.97 * 300  # 6 draws of 50 in 100,000 rows: new ones
