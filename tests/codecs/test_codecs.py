"""triclip.codecs and triclip.codecs.allocation: every registered code searches like exact search over its own
decoded vectors, stores exactly the bytes it promises, survives a save / load, and the bit allocation is the optimum.

The per-codec tests run over the registry (``codecs.names()``): a codec added to it is tested here unchanged, on
its first candidate at 8, 4, 16 or 32 bytes per vector (D = 32, 600 vectors)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from triclip import codecs
from triclip.codecs import allocation
from triclip.codecs.base import unit_prefix
from triclip.index.faiss_index import recall_at_k
from triclip.index.vectors import exact_topk
from triclip.core.errors import UserError

D = 32
K = 10


def _vectors(n: int, seed: int = 0) -> np.ndarray:
    """Unit vectors whose variance falls with the column (importance order). Shape: (n, D)."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n, D)) * np.linspace(2.0, 0.1, D)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.fixture(scope="module")
def data():
    x = _vectors(600)
    q = _vectors(40, seed=1)
    return x, q


def _small_spec(name: str, n: int = 600) -> codecs.CodecSpec:
    """The codec's first candidate at 8, 4, 16 or 32 bytes per vector, D = 32 (small: training stays quick); for
    a code offered only to large collections (inverted lists), its candidate for a million vectors (fitted on
    600, it takes fewer lists)."""
    for size in (n, 10**6):
        for budget in (8, 4, 16, 32):
            specs = [s for s in codecs.candidates(budget, D, size) if s.codec == name]
            if specs:
                return specs[0]
    raise AssertionError(f"codec {name} has no candidate at 4 to 32 bytes for D = {D}: give it one to be tested here")


def _fit_and_fill(spec: codecs.CodecSpec, x: np.ndarray) -> codecs.Codec:
    codec = codecs.fit(spec, x)
    codec.add(x[:300])
    codec.add(x[300:])  # two adds: ids continue
    return codec


@pytest.fixture(scope="module")
def fitted(data):
    x, _ = data
    return {name: _fit_and_fill(_small_spec(name), x) for name in codecs.names()}


def _query_side(codec, q: np.ndarray) -> np.ndarray:
    """The query as the codec scores it: a symmetric code (binary) encodes it as it encodes the vectors."""
    if not codec.symmetric:
        return q
    coded = codec.empty_copy()
    coded.add(q)
    return coded.reconstruct()


ESTIMATE_ERROR = 0.1  # an estimating code's score (fast scan's 8-bit tables, RaBitQ) against the exact inner
# product with its decoded vector, on these unit vectors (measured: fast scan <= 0.01, RaBitQ <= 0.09)


def _check_search(codec, q: np.ndarray) -> None:
    """Search is exact search over the decoded vectors (a symmetric code: over decoded queries too, its scores up to
    one positive scale, e.g. binary's sign-vector inner products), every list scanned for inverted lists. A code
    whose scores are estimates (``exact_scan`` False) is within :data:`ESTIMATE_ERROR` of them and finds most of
    the same top 10."""
    decoded = codec.reconstruct()  # (n, D)
    assert decoded.shape == (len(codec), D)
    assert not decoded[:, codec.spec.m :].any()  # zeros beyond m
    scores, ids = codec.search(q, K, params=codec.exhaustive())
    assert scores.shape == ids.shape == (len(q), K)
    assert (np.diff(scores, axis=1) <= 1e-5).all()  # best first
    assert all(len(set(row)) == K for row in ids.tolist()) and ids.min() >= 0
    qs = _query_side(codec, q)
    truth = exact_topk(decoded, qs, K)
    exact_scores = np.sort(qs @ decoded.T, axis=1)[:, ::-1][:, :K]
    own = np.einsum("qd,qkd->qk", qs, decoded[ids])  # exact score of each id returned
    scale = float((scores * own).sum() / (own * own).sum()) if codec.symmetric else 1.0
    assert scale > 0
    if not codec.exact_scan:
        np.testing.assert_allclose(scores, own, atol=ESTIMATE_ERROR)
        assert recall_at_k(ids, truth) >= 0.7
        return
    np.testing.assert_allclose(scores, exact_scores * scale, rtol=1e-4, atol=1e-4)  # ties may swap ids, not scores
    np.testing.assert_allclose(scores, own * scale, rtol=1e-4, atol=1e-4)
    if not codec.symmetric:  # Hamming distances tie often: there the scores above are the check
        assert recall_at_k(ids, truth) >= 0.99


def _check_round_trip(codec, q: np.ndarray, folder) -> None:
    """Saved and loaded through the registry: the same code, the same answers; bytes per vector as stored."""
    assert codec.code_bytes() == codec.spec.bytes_per_vector * len(codec)
    path = folder / f"{codec.spec.codec}.codec"
    codec.save(path)
    back = codecs.load(path, dim=D)
    assert type(back) is type(codec) and back.spec == codec.spec and back.dim == D and len(back) == len(codec)
    np.testing.assert_array_equal(back.reconstruct([3, 7]), codec.reconstruct([3, 7]))
    np.testing.assert_array_equal(codec.search(q, K)[1], back.search(q, K)[1])
    assert codecs.CodecSpec.from_json(codec.spec.to_json()) == codec.spec
    assert list(folder.iterdir()) == [path]  # nothing left beside it


def _check_empty_copy(codec, x: np.ndarray) -> None:
    copy = codec.empty_copy()
    assert len(copy) == 0 and copy.spec == codec.spec and len(codec) == len(x)
    copy.add(x[:50])
    np.testing.assert_array_equal(copy.reconstruct(), codec.reconstruct(np.arange(50)))


@pytest.mark.parametrize("name", codecs.names())
def test_search_equals_exact_search_over_its_decoded_vectors(fitted, data, name):
    _check_search(fitted[name], data[1])


@pytest.mark.parametrize("name", codecs.names())
def test_bytes_per_vector_is_the_stored_code_size(fitted, name):
    codec = fitted[name]
    assert codec.code_bytes() == codec.spec.bytes_per_vector * len(codec) == codec.spec.bytes_per_vector * 600


@pytest.mark.parametrize("name", codecs.names())
def test_save_load_round_trip(fitted, data, tmp_path, name):
    _check_round_trip(fitted[name], data[1], tmp_path)


@pytest.mark.parametrize("name", codecs.names())
def test_empty_copy_is_the_same_code_without_vectors(fitted, data, name):
    _check_empty_copy(fitted[name], data[0])


@pytest.mark.parametrize("name", codecs.names())
def test_each_codec_has_a_label_a_description_and_words_for_charts_and_tables(fitted, name):
    codec = fitted[name]
    cls = codecs.lookup(name)
    assert cls.name == name and codecs.CodecSpec(name, 4, 4).codec == name
    words = codecs.describe(codec.spec)
    assert words.startswith(codec.spec.label() + ": ") and len(words) > len(codec.spec.label()) + 20
    assert f"{codec.spec.bytes_per_vector} byte" in words
    assert codecs.describe(_small_spec(name)).startswith(_small_spec(name).label())  # a candidate, before fitting
    assert cls.title and codecs.title(name) == cls.title and codecs.family(name) == cls.family


def test_binary_scores_are_the_inner_products_of_the_sign_vectors(fitted, data):
    codec = fitted["binary"]
    q = data[1]
    scores, ids = codec.search(q, K)
    signs = lambda v: np.where(v[..., : codec.spec.m] > 0, 1.0, -1.0)  # noqa: E731
    expected = np.einsum("qd,qkd->qk", signs(q), signs(codec.reconstruct()[ids]))
    np.testing.assert_array_equal(scores, expected)


def test_the_registry_order_is_the_order_candidates_are_tried():
    """Ties in measured recall go to the earlier candidate: the codecs of today keep their order."""
    assert codecs.names()[:7] == ("float32", "int8", "binary", "pq", "opq", "rq", "mixed")
    order = [s.codec for s in codecs.candidates(4, 256)]
    assert order == sorted(order, key=codecs.names().index)
    with pytest.raises(ValueError, match="registered twice"):
        codecs.register_codec("pq")(type("Again", (codecs.Codec,), {}))
    with pytest.raises(UserError, match=r"unknown codec 'lz4'; choose from float32, int8, binary, pq, opq, rq, mixed"):
        codecs.lookup("lz4")
    assert codecs.title("from-a-later-version") == "from-a-later-version"  # an index written by another version


def test_search_parameters_are_refused_by_codes_without_any(fitted, data):
    """``search(q, k, params)`` is the hook for codes with per-call settings: inverted lists take nprobe (and
    nothing else), the other codes none."""
    for codec in fitted.values():
        assert codec.search_parameters(None) is None and codec.search_parameters({}) is None
        if codec.exhaustive() is None:
            with pytest.raises(UserError, match="takes no search parameters, got nprobe"):
                codec.search(data[1], K, params={"nprobe": 4})
            continue
        assert codec.search(data[1], K, params={"nprobe": 4})[1].shape == (len(data[1]), K)
        with pytest.raises(UserError, match="nprobe"):
            codec.search(data[1], K, params={"efSearch": 4})
        with pytest.raises(UserError, match="positive"):
            codec.search(data[1], K, params={"nprobe": 0})


@pytest.fixture
def scratch_registry():
    """Codecs registered in a test are gone after it."""
    before = dict(codecs.CODECS)
    yield
    codecs.CODECS.clear()
    codecs.CODECS.update(before)


def test_a_codec_is_one_registered_class(scratch_registry, data, tmp_path):
    """A float16 top-m code, registered here only: it is a candidate, fits, searches, and is loaded back as itself
    (not as int8, also a FAISS scalar quantiser), with no other change; the command line offers it."""
    import faiss

    from triclip.app.cli import _codec_names
    from triclip.codecs.base import METRIC, prefix_candidates
    from triclip.codecs.faiss_codec import FaissCodec

    @codecs.register_codec("float16")
    class Float16Codec(FaissCodec):
        title = family = "float16 top-m"

        @classmethod
        def describe(cls, spec):
            return f"{spec.label()}: the first {spec.m} dimensions as 16-bit floats; {2 * spec.m} bytes per vector"

        @classmethod
        def candidates(cls, budget, dim, n=None):
            return prefix_candidates(cls.name, budget, dim, bits=16)

        @classmethod
        def faiss_parts(cls, spec, n):
            return spec, faiss.IndexScalarQuantizer(spec.m, faiss.ScalarQuantizer.QT_fp16, METRIC), None

        @classmethod
        def owns_index(cls, inner, chain):
            return isinstance(inner, faiss.IndexScalarQuantizer) and inner.sq.qtype == faiss.ScalarQuantizer.QT_fp16

    x, q = data
    assert "float16" in codecs.names() and "float16" in _codec_names()
    assert [s.label() for s in codecs.candidates(8, D) if s.codec == "float16"] == ["float16 m=4", "float16 m=2"]
    spec = _small_spec("float16")
    assert spec == codecs.CodecSpec("float16", 4, 8) and codecs.describe(spec).startswith("float16 m=4: the first 4")
    codec = _fit_and_fill(spec, x)
    assert isinstance(codec, Float16Codec)
    _check_search(codec, q)
    _check_round_trip(codec, q, tmp_path)
    _check_empty_copy(codec, x)
    np.testing.assert_allclose(codec.reconstruct()[:, :4], codecs.unit_prefix(x, 4)[:, :4], atol=1e-3)  # 16-bit floats


def test_load_refuses_a_file_that_is_not_a_codec(tmp_path):
    bad = tmp_path / "x.codec"
    bad.write_text("hello")
    with pytest.raises(UserError, match="not a codec"):
        codecs.load(bad)
    with pytest.raises(UserError, match="cannot read"):
        codecs.load(tmp_path / "missing")


def test_a_pruned_code_stores_the_prefix_at_unit_length(data):
    """float32 at m < D holds the first m coordinates re-normalised (today's top-m index), so mixed keeps theirs too."""
    x, _ = data
    codec = codecs.fit(codecs.CodecSpec("float32", 8, 32), x)
    codec.add(x)
    expected = x[:, :8] / np.linalg.norm(x[:, :8], axis=1, keepdims=True)
    np.testing.assert_allclose(codec.reconstruct()[:, :8], expected, rtol=1e-6)
    mixed = codecs.fit(codecs.CodecSpec("mixed", D, 2), x)
    mixed.add(x)
    kept = np.array(mixed.spec.params["bits"]) > 0
    raw = np.linalg.norm(x[:, : mixed.spec.m][:, kept], axis=1)  # ~0.8: what the kept dimensions hold
    assert mixed.spec.m < D and raw.mean() < 0.85
    assert abs(np.linalg.norm(mixed.reconstruct(), axis=1).mean() - 1) < 0.06  # unit up to the 1-2 bit quantisation


def test_codes_get_closer_with_more_bytes(data):
    """Recall of each family against the float vectors' own top 10 grows with the budget."""
    x, q = data
    truth = exact_topk(x, q, K)

    def recall(spec):
        codec = codecs.fit(spec, x)
        codec.add(x)
        return recall_at_k(codec.search(q, K)[1], truth)

    assert recall(codecs.CodecSpec("mixed", D, 4)) < recall(codecs.CodecSpec("mixed", D, 32))
    assert recall(codecs.CodecSpec("int8", 4, 4)) < recall(codecs.CodecSpec("int8", 32, 32))
    assert recall(codecs.CodecSpec("rq", D, 2, {"M": 2, "nbits": 8})) < recall(codecs.CodecSpec("rq", D, 8, {"M": 8, "nbits": 8}))
    assert recall(codecs.CodecSpec("float32", D, 4 * D)) == 1.0


@pytest.mark.parametrize("budget", [1, 4, 8, 16, 64, 128, 512])
def test_candidates_fit_the_budget(budget):
    specs = codecs.candidates(budget, 256)
    assert specs and all(s.bytes_per_vector <= budget and 1 <= s.m <= 256 for s in specs)
    assert {s.codec for s in specs} >= {"int8", "binary", "mixed"}
    assert ("opq" in {s.codec for s in specs}) == (budget <= 32)  # OPQ up to D/8 sub-quantisers
    assert ("rq" in {s.codec for s in specs}) == (budget <= codecs.RQ_MAX_CODES)
    for s in specs:
        if s.codec == "rq":  # one byte per codebook, each over the whole width
            assert s.m == 256 and s.params == {"M": budget, "nbits": 8} and s.bytes_per_vector == budget
        if s.codec in ("pq", "opq"):
            assert s.m % s.params["M"] == 0 and s.params["M"] * s.params["nbits"] // 8 == s.bytes_per_vector
            assert s.m // s.params["M"] >= (codecs.PQ_DIMS_PER_CODE if s.codec == "pq" else codecs.OPQ_DIMS_PER_CODE)
        if s.codec == "binary":
            assert s.m % 8 == 0 and s.bytes_per_vector == s.m // 8
    float_m = [s.m for s in specs if s.codec == "float32"]
    assert max(float_m, default=0) == min(256, budget // 4)  # today's pruning: the largest m that fits


def test_candidates_refuse_a_budget_below_one_byte():
    with pytest.raises(UserError):
        codecs.candidates(0, 16)


def test_pq_on_a_small_collection_uses_fewer_centroids_and_says_so():
    x = _vectors(40)
    codec = codecs.fit(codecs.CodecSpec("pq", 16, 8, {"M": 8, "nbits": 8}), x)
    assert codec.spec.params["nbits"] == 5 and codec.spec.bytes_per_vector == 5  # 8 x 5 bits
    codec.add(x)
    assert codec.code_bytes() == 5 * 40
    with pytest.raises(UserError, match="at least 2"):
        codecs.fit(codecs.CodecSpec("pq", 16, 8, {"M": 8, "nbits": 8}), x[:1])


def test_opq_below_256_vectors_is_refused_in_one_line_not_a_crash():
    """FAISS 1.15's OPQMatrix aborts the process (heap corruption) training codes under 8 bits (D=256, n=190):
    the code refuses before FAISS sees it. Run in a child so that a regression fails here, not the suite."""
    import subprocess
    import sys

    code = (
        "import numpy as np; from triclip import codecs; from triclip.core.errors import UserError\n"
        "x = np.random.default_rng(0).standard_normal((190, 256)).astype('float32')\n"
        "try:\n    codecs.fit(codecs.CodecSpec('opq', 256, 16, {'M': 16, 'nbits': 8}), x)\n"
        "except UserError as err:\n    print('refused:', err)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-500:]
    assert "refused:" in done.stdout and "at least 256 training vectors" in done.stdout


def test_bad_specs_and_inputs_are_one_line_errors(data):
    x, _ = data
    with pytest.raises(UserError, match="unknown codec"):
        codecs.CodecSpec("lz4", 8, 8)
    with pytest.raises(UserError, match="multiple of 8"):
        codecs.fit(codecs.CodecSpec("binary", 12, 2), x)
    with pytest.raises(UserError, match="m <= D"):
        codecs.fit(codecs.CodecSpec("int8", D + 1, D + 1), x)
    codec = codecs.fit(codecs.CodecSpec("int8", 8, 8), x)
    with pytest.raises(UserError, match=r"\(n, 32\)"):
        codec.add(x[:, :8])


# ---------------------------------------------------------------------------- the allocation


def _brute_force(cost: np.ndarray, budget: int) -> float:
    d, k = cost.shape
    return min(
        allocation.modelled_distortion(cost, np.array(b))
        for b in itertools.product(range(k), repeat=d)
        if sum(b) <= budget
    )


@pytest.mark.parametrize("seed", range(12))
def test_allocation_is_the_brute_force_optimum(seed):
    rng = np.random.default_rng(seed)
    d = int(rng.integers(1, 6))
    k = int(rng.integers(2, 5))
    budget = int(rng.integers(0, d * (k - 1) + 2))
    # measured-like errors: variance at 0 bits, then falling, not always convex (the first bit can help least)
    var = rng.uniform(0.1, 3.0, d)
    falls = np.cumprod(np.c_[np.ones(d), rng.uniform(0.1, 0.9, (d, k - 1))], axis=1)
    cost = rng.uniform(0.1, 2.0, d)[:, None] * var[:, None] * falls
    bits = allocation.allocate(cost, budget)
    assert bits.sum() <= budget and bits.min() >= 0 and bits.max() < k
    assert allocation.modelled_distortion(cost, bits) == pytest.approx(_brute_force(cost, budget))


def test_allocation_beats_greedy_where_the_first_bit_helps_least():
    cost = np.array([[1.0, 0.9, 0.0], [0.5, 0.0, 0.0]])  # dim 0 needs 2 bits to pay off
    bits = allocation.allocate(cost, 2)
    assert bits.tolist() == [2, 0]  # greedy (best first step) would take dim 1's bit: cost 1.0, not 0.5


def test_top_m_pruning_is_the_special_case():
    """Equal weights, variances far apart: all bits on the leading dimensions, none on the rest."""
    cost = np.array([[100.0 * 4.0**-b for b in range(9)], [50.0 * 4.0**-b for b in range(9)], [1e-6] * 9])
    assert allocation.allocate(cost, 16).tolist() == [8, 8, 0]


def test_water_filling_more_weight_more_bits():
    x = _vectors(2000)
    lo, hi, mse = allocation.quantiser_table(x)
    bits = allocation.allocate(allocation.query_weights(x)[:, None] * mse, 64)
    assert bits.sum() == 64
    assert bits[:4].min() >= bits[-4:].max()  # the high-variance leading dimensions get at least as many bits
    assert (mse[:, 1:] <= mse[:, :1] + 1e-12).all() and (np.diff(mse[:, 1:], axis=1) <= 1e-9).all()


@pytest.mark.parametrize("n, budget_bits", [(2000, 64), (300, 7), (25_000, 200)])  # 25,000 > TABLE_SAMPLE: sampled
def test_quantiser_ranges_are_the_tables_pick_at_each_dimensions_own_width(n, budget_bits):
    """The mixed fit's ranges, measured at each dimension's own bit width only: bit for bit the full table's entry
    (0 where a dimension is pruned), on an allocation with pruned, 1-bit and wide dimensions."""
    x = _vectors(n, seed=n)
    bits = allocation.allocate(allocation.query_weights(x)[:, None] * allocation.quantiser_table(x)[2], budget_bits)
    assert (bits == 0).any() and (bits > 0).any()
    x = unit_prefix(x, bits > 0)
    lo, hi, _ = allocation.quantiser_table(x)
    got_lo, got_hi = allocation.quantiser_ranges(x, bits)
    assert np.array_equal(got_lo, lo[np.arange(D), bits]) and np.array_equal(got_hi, hi[np.arange(D), bits])
    assert got_lo.dtype == got_hi.dtype == np.float32 and (got_lo[bits == 0] == 0).all()


def test_mixed_fit_reuses_the_error_table_of_the_same_rows_with_the_same_code():
    """A second fit on the same rows (another budget of one build) reads the remembered table: the same code as a
    fit with nothing remembered; other rows get their own table."""
    from triclip.codecs import mixed

    x, other = _vectors(1500, seed=3), _vectors(1500, seed=4)
    mixed._TABLES.clear()
    fresh = {b: codecs.fit(codecs.CodecSpec("mixed", D, b), x) for b in (2, 8)}
    assert len(mixed._TABLES) == 1  # the 8 B fit used the 2 B fit's table
    codecs.fit(codecs.CodecSpec("mixed", D, 4), other)
    assert len(mixed._TABLES) == 2
    again = codecs.fit(codecs.CodecSpec("mixed", D, 8), x)
    mixed._TABLES.clear()
    for b, first in fresh.items():
        alone = codecs.fit(codecs.CodecSpec("mixed", D, b), x)
        assert alone.spec == first.spec and np.array_equal(alone.lo, first.lo) and np.array_equal(alone.hi, first.hi)
    assert again.spec == fresh[8].spec and np.array_equal(again.lo, fresh[8].lo)


def test_pack_unpack_round_trip():
    rng = np.random.default_rng(0)
    bits = np.array([3, 0, 8, 1, 5])
    codes = np.stack([rng.integers(0, 2**b, 50) if b else np.zeros(50, int) for b in bits], axis=1)
    packed = allocation.pack(codes, bits)
    assert packed.shape == (50, 3)  # 17 bits -> 3 bytes
    np.testing.assert_array_equal(allocation.unpack(packed, bits), codes)


def test_rq_encodes_with_capped_memory_after_fit_copy_and_load(fitted, tmp_path):
    """FAISS's RQ keeps 5 GB of beam-search tables by default (adding 300k vectors peaked at 6.8 GB) and does not save
    the cap in its file: every way to get an RQ code (fit, empty copy, load) encodes within ``RQ_MEMORY``."""
    import faiss

    codec = fitted["rq"]
    codec.save(tmp_path / "rq.codec")
    loaded = codecs.load(tmp_path / "rq.codec")
    for c in (codec, codec.empty_copy(), loaded, loaded.empty_copy()):
        assert faiss.downcast_index(c.index.index).rq.max_mem_distances == codecs.RQ_MEMORY < 5 << 30
