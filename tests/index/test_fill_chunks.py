"""Codes filled a slice of a shard at a time (ShardVectors.chunked) against a shard at a time."""

from __future__ import annotations

import numpy as np

from triclip import codecs
from triclip.codecs.spec import CodecSpec
from triclip.index import budgets
from triclip.index import scale
from triclip.index.vectors import ShardFile, ShardVectors


def _three_shards(folder) -> tuple[list[np.ndarray], ShardVectors]:
    """Shards of 5, 0 and 12 rows (D = 8, float16) saved as .npy in ``folder``: the arrays, and the files opened."""
    rng = np.random.default_rng(0)
    parts = [rng.standard_normal((n, 8)).astype(np.float16) for n in (5, 0, 12)]
    for s, p in enumerate(parts):
        np.save(folder / f"{s}.npy", p)
    return parts, ShardVectors.of([ShardFile(folder / f"{s}.npy") for s in range(3)])


def test_chunks_are_the_same_rows_in_order_read_from_the_files(tmp_path):
    parts, vectors = _three_shards(tmp_path)
    chunked = vectors.chunked(4)
    assert [len(p) for p in chunked.parts] == [4, 1, 4, 4, 4] and chunked.count == vectors.count
    np.testing.assert_array_equal(np.concatenate([np.asarray(p) for p in chunked.parts]), np.concatenate(parts))
    np.testing.assert_array_equal(chunked.rows(np.array([0, 4, 5, 16]), 8), vectors.rows(np.array([0, 4, 5, 16]), 8))


def test_a_head_is_the_first_rows_across_shards_read_from_the_files(tmp_path):
    parts, vectors = _three_shards(tmp_path)
    every = np.concatenate(parts)
    for n in (3, 5, 9, 17, 40):
        head = vectors.head(n)
        assert head.count == min(n, 17)
        np.testing.assert_array_equal(np.concatenate([np.asarray(p) for p in head.parts]), every[:n])
        np.testing.assert_array_equal(head.rows(np.arange(head.count), 8), vectors.rows(np.arange(head.count), 8))


def test_a_pq_filled_in_chunks_holds_the_codes_of_one_filled_a_shard_at_once(tmp_path):
    """PQ16x8 at m = 256: sub-vectors of 16 dims, the encoder's distance-table path (16 KiB a row)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3000, 256)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    vectors = ShardVectors.of([x[:1700], x[1700:]])
    codec = codecs.fit(CodecSpec("pq", 256, 16, {"M": 16, "nbits": 8}), x[:2000])
    whole, chunked = scale.fill(codec, vectors), scale.fill(codec, vectors.chunked(256))
    whole.save(tmp_path / "whole")
    chunked.save(tmp_path / "chunked")
    assert len(chunked) == 3000
    assert (tmp_path / "whole").read_bytes() == (tmp_path / "chunked").read_bytes()
