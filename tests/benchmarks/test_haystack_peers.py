"""benchmarks.haystack_peers: the pure pieces (percentiles, overlap, byte sizing, memory caps, the table) and the
worker's own helpers on tiny arrays; the peers' runs themselves are benchmarks, not tests."""

import numpy as np
import pytest

from benchmarks import haystack_peer_worker as worker
from benchmarks import haystack_peers as hp


def test_percentiles_of_known_times():
    ms = list(range(1, 101))  # 1..100 ms
    p50, p99 = hp.percentiles(ms)
    assert p50 == pytest.approx(50.5)
    assert p99 == pytest.approx(99.01)


def test_overlap_counts_shared_ids_of_the_top_k():
    truth = np.array([[0, 1, 2, 3], [4, 5, 6, 7]])
    found = np.array([[3, 2, 9, 9], [7, 8, 8, 8]])  # 2 of 4, then 1 of 4
    assert hp.overlap(found, truth, k=4) == pytest.approx((0.5 + 0.25) / 2)
    assert hp.overlap(truth, truth, k=4) == 1.0
    assert worker.overlap(found, truth) == pytest.approx(0.375)


def test_usearch_dtype_matches_bytes_per_vector():
    assert hp.usearch_dtype(32, 256) == "b1"  # 256 bits
    assert hp.usearch_dtype(256, 256) == "i8"
    assert hp.usearch_dtype(512, 256) == "f16"
    assert hp.usearch_dtype(16, 256) is None  # no dtype takes 16 B at D = 256


def test_memory_cap_holds_codes_and_ids_or_triclips_own():
    assert hp.memory_cap(4, 1_000_000) == 12_000_000
    assert hp.memory_cap(4, 1_000_000, triclip_ram=20_000_000) == 20_000_000
    assert hp.memory_cap(32, 1000, triclip_ram=None) == 40_000


def test_nlist_is_a_power_of_two_near_sqrt_n():
    assert hp.nlist_for(1_000_000) == 1024
    assert hp.nlist_for(100_000) == 256
    assert hp.nlist_for(100) == 16


def test_mean_sd_and_fmt():
    assert hp.mean_sd([1.0, 2.0, 3.0]) == (2.0, 1.0)
    assert hp.mean_sd([5.0]) == (5.0, 0.0)
    assert hp.fmt([0.1, 0.3]) == "0.200 ± 0.141"
    assert hp.fmt([0.25]) == "0.250"


def test_table_averages_seeds_and_shows_errors():
    recs = [{"seed": s, "budget": 8, "method": "faiss", "label": "IVF", "recall@10": r, "code_bytes": 8}
            for s, r in ((0, 0.2), (1, 0.4))]
    recs.append({"seed": 0, "budget": 8, "method": "autofaiss", "error": "no index fits"})
    text = hp.table(recs)
    faiss_row = next(line for line in text.splitlines() if "| faiss |" in line)
    assert "0.300 ± 0.141" in faiss_row and "| 2 |" in faiss_row
    auto_row = next(line for line in text.splitlines() if "| autofaiss |" in line)
    assert "no index fits" in auto_row and "| 0 |" in auto_row


def test_usearch_rows_pack_sign_bits():
    x = np.array([[0.5, -0.1, 0.2, -0.3, 0.1, 0.1, -0.2, 0.4]], np.float32)
    assert worker.usearch_rows(x, "b1").tolist() == [[0b10101101]]
    assert worker.usearch_rows(x, "f16").dtype == np.float32


def test_sample_rows_draws_distinct_rows_across_parts(tmp_path):
    parts = [np.arange(i * 10, i * 10 + 10, dtype=np.float32)[:, None] * np.ones((1, 2), np.float32) for i in range(3)]
    for i, p in enumerate(parts):
        np.save(tmp_path / f"{i:04d}.npy", p)
    got = worker.sample_rows(worker.npy_parts(str(tmp_path)), 12, seed=1)
    assert got.shape == (12, 2)
    assert len(set(got[:, 0].tolist())) == 12 and set(got[:, 0].tolist()) <= set(range(30))
    assert worker.sample_rows(worker.npy_parts(str(tmp_path)), 99).shape == (30, 2)  # at most every row
