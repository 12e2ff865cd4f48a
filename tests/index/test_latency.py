"""The latency model's extrapolation to N (``triclip.index.latency``), with the timings injected: no test times."""

import numpy as np
import pytest

from triclip import codecs
from triclip.codecs.ivf import lists_for
from triclip.index import latency

from .conftest import unit_vectors


def test_lists_are_charged_for_the_lists_n_will_have_not_the_samples():
    """The 10M, 32 B case: lists of 128 on the sample, 16 probed (12.5% of the 200,000 timed rows), timed at
    0.89 ms of which 0.30 before the scan. Scaled as a flat code they were put at 30 ms; at N the code has
    lists_for(10M) = 16,384 lists, a query scans 4 x 16 of them."""
    timed, fixed, coarse, rows, n = 0.89, 0.30, 0.7, 200_000, 10_000_000
    nlist_n, nprobe_n = latency.lists_at_n(n, 16)
    assert (nlist_n, nprobe_n) == (16_384, 64)
    per_code = (timed - fixed) / (rows * 16 / 128)  # ms per code scanned in the timing
    expected = fixed + coarse + per_code * n * 64 / 16_384
    got = latency.lists_ms(timed, fixed, coarse, rows, 128, 16, n)
    assert got == pytest.approx(expected)
    flat = fixed + (timed - fixed) * n / rows
    assert flat > 10 * got  # what the sample's share of the rows said
    # the probe at N is capped at a quarter of N's lists
    assert latency.lists_at_n(n, 10_000) == (16_384, 4096)
    assert latency.lists_at_n(1_000_000, 8) == (lists_for(1_000_000), 32)


def test_a_lists_code_timed_below_n_is_extrapolated_through_the_lists_at_n(monkeypatch):
    """``LatencyModel.search`` on a real inverted code holding a sample: timed on TIME_ROWS entries of the sample's
    lists, then charged for N's lists and nprobe, and the coarse search over N's lists at that nprobe."""
    x = unit_vectors(np.random.default_rng(0), 2000, 32)
    spec = codecs.CodecSpec("ivf", 32, 8, {"inner": "pq", "M": 8, "nbits": 4, "nlist": 16, "nprobe": 2})
    codec = codecs.fit(spec, x)
    codec.add(x)
    timings = iter([2.0, 0.5])  # the query at TIME_ROWS entries, then at TINY (before the scan)
    searched = []

    def median_ms(search, queries, prepare=lambda: None, reps=latency.REPS):
        searched.append(search(queries[:1]))  # each timed search runs
        return next(timings)

    coarse = []
    monkeypatch.setattr(latency, "_median_ms", median_ms)
    monkeypatch.setattr(latency, "TIME_ROWS", 4000)
    model = latency.LatencyModel()
    monkeypatch.setattr(model, "coarse_ms", lambda m, nlist, nprobe, q: coarse.append((m, nlist, nprobe)) or 0.25)
    got = model.search(codec, x[:5], 10, 1_000_000)
    assert len(codec) == 4000 and len(searched) == 2
    assert coarse == [(32, 4096, 8)]
    assert got.how == "extrapolated"
    assert got.ms == pytest.approx(latency.lists_ms(2.0, 0.5, 0.25, 4000, 16, 2, 1_000_000))
    # a given nprobe is the one charged
    timings = iter([2.0, 0.5])
    got = model.search(codec, x[:5], 10, 1_000_000, params={"nprobe": 4})
    assert coarse[-1] == (32, 4096, 16)
    assert got.ms == pytest.approx(latency.lists_ms(2.0, 0.5, 0.25, 4000, 16, 4, 1_000_000))


def test_a_flat_code_is_still_scaled_by_the_rows(monkeypatch):
    x = unit_vectors(np.random.default_rng(1), 600, 32)
    codec = codecs.fit(codecs.CodecSpec("pq", 32, 8, {"M": 8, "nbits": 4}), x)
    codec.add(x)
    timings = iter([2.0, 0.5])
    monkeypatch.setattr(latency, "_median_ms", lambda search, queries, **kw: next(timings))
    monkeypatch.setattr(latency, "TIME_ROWS", 1000)
    got = latency.LatencyModel().search(codec, x[:5], 10, 100_000)
    assert got.ms == pytest.approx(0.5 + 1.5 * 100_000 / 1000) and got.how == "extrapolated"


def test_binary_lists_keep_the_samples_lists_at_n_and_are_scaled_by_the_rows(monkeypatch):
    """Binary inverted lists are not refitted for N (no ``sized_for``): N's rows fill the sample's lists."""
    x = unit_vectors(np.random.default_rng(3), 2000, 32)
    codec = codecs.fit(codecs.CodecSpec("binary_ivf", 32, 4, {"nlist": 16, "nprobe": 2}), x)
    codec.add(x)
    assert codec.exhaustive() is not None and not hasattr(codec, "sized_for")
    timings = iter([2.0, 0.5])
    monkeypatch.setattr(latency, "_median_ms", lambda search, queries, **kw: next(timings))
    monkeypatch.setattr(latency, "TIME_ROWS", 4000)
    got = latency.LatencyModel().search(codec, x[:5], 10, 1_000_000)
    assert got.ms == pytest.approx(0.5 + 1.5 * 1_000_000 / 4000)


def test_the_coarse_search_is_timed_once_per_shape(monkeypatch):
    calls = []
    monkeypatch.setattr(latency, "_median_ms", lambda search, queries, **kw: calls.append(search(queries[:1])) or 1.5)
    model = latency.LatencyModel()
    q = unit_vectors(np.random.default_rng(2), 4, 256)
    assert model.coarse_ms(32, 64, 4, q) == 1.5 and model.coarse_ms(32, 64, 4, q) == 1.5
    distances, ids = calls[0]
    assert len(calls) == 1 and ids.shape == (1, 4) and ids.max() < 64


def test_a_probe_is_given_in_the_time_scale_of_the_float_scan_it_is_held_to(monkeypatch):
    """The machine runs twice as fast after the bound's float scan was timed: a twin whose scan takes 1.2x the float
    scan's measures under the bound, and the float scan timed again right after it brings it back to 1.2x."""
    speed = {"now": 1.0}
    work = {"float32": 1.0, "rq": 1.2}  # ms of one query at speed 1

    def search(self, codec, queries, k, n, params=None):
        return latency.Latency(work[codec.spec.codec] / speed["now"], "measured")

    monkeypatch.setattr(latency.LatencyModel, "search", search)
    model = latency.LatencyModel()
    rng = np.random.default_rng(0)
    sample, queries = unit_vectors(rng, 300, 32), unit_vectors(rng, 5, 32)
    bound = model.float_scan(sample, queries, 300)
    spec = next(s for s in codecs.candidates(4, 32, 300) if s.codec == "rq")
    speed["now"] = 2.0
    assert model.search(codecs.lookup("rq").probe(spec, 32), queries, 10, 300).ms == 0.6 < bound.ms == 1.0
    assert model.probe(spec, sample, 300, queries).ms == pytest.approx(1.2)
    assert model.float_scan(sample, queries, 300) == bound  # the bound itself stays as first timed
    assert model.probe(codecs.candidates(4, 32, 300)[0], sample, 300, queries) is None  # float32: no twin
