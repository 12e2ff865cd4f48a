"""The full-D vectors kept as 8-bit codes (``index build --vectors sq8``): FAISS's scalar quantiser after a fixed
random rotation, read like a float array, chosen by the free disk after float16, recorded and checked by the manifest, and searched, re-ranked, grown
and exported as float vectors are."""

from __future__ import annotations

import json
import shutil
from collections import namedtuple

import faiss
import numpy as np
import pytest

from triclip.core.errors import UserError
from triclip.index import vectors as vec
from triclip.index.diskrows import DiskRows
from triclip.index.milvus_export import _mapped, _ranges
from triclip.index.search import Searcher, rerank, rerank_from
from triclip.index.sources import IndexBuildConfig, build_index
from triclip.index.store import MANIFEST, current_version, load_contents
from triclip.index.vectors import SQ8Rows, stored_dtype
from tests.index.test_from_embeddings import emb  # noqa: F401 (the same fixture)

GB = 10**9


def _unit(rng, n: int, d: int = 64) -> np.ndarray:
    x = rng.standard_normal((n, d)).astype(np.float32)
    x[:, d // 4 :] *= 0.2  # mass in a prefix, as importance-ordered vectors hold it
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _faiss_reference(x: np.ndarray) -> "faiss.IndexPreTransform":
    """FAISS's own index of the same code: the rotation as a ``LinearTransform``, then ``IndexScalarQuantizer``
    (QT_8bit), trained on ``x``."""
    turn = vec.rotation(x.shape[1])
    lt = faiss.LinearTransform(x.shape[1], x.shape[1], False)
    faiss.copy_array_to_vector(np.ascontiguousarray(turn.T).ravel(), lt.A)  # FAISS turns x into A x = (x @ turn)^T
    lt.is_trained = True
    lt.set_is_orthonormal()
    inner = faiss.IndexScalarQuantizer(x.shape[1], faiss.ScalarQuantizer.QT_8bit, faiss.METRIC_INNER_PRODUCT)
    ref = faiss.IndexPreTransform(lt, inner)
    ref.train(x)
    ref.add(x)
    return ref


def test_sq8_rows_code_and_decode_as_faiss_own_rotation_and_scalar_quantiser_index():
    x = _unit(np.random.default_rng(0), 3000)
    ref = _faiss_reference(x)
    store = SQ8Rows(np.empty((0, 64), np.uint8), SQ8Rows.fit(x))
    np.testing.assert_allclose(store.params, faiss.vector_to_array(faiss.downcast_index(ref.index).sq.trained),
                               atol=1e-6)
    codes = store.encode(x)
    assert codes.dtype == np.uint8 and codes.shape == x.shape
    same = codes == ref.sa_encode(x)  # the transform, then the codes; float rounding may move a few by one step
    assert same.mean() > 0.999
    rows = store.with_codes(codes)
    np.testing.assert_allclose(rows[np.arange(3000)][same.all(1)], ref.reconstruct_n(0, 3000)[same.all(1)], atol=1e-6)
    ids = np.array([[5, 7, 5], [2999, 0, 1]])  # any key numpy takes: (2, 3) -> (2, 3, D)
    assert rows[ids].shape == (2, 3, 64) and rows[ids].dtype == np.float32
    np.testing.assert_allclose(rows[ids][1, 0], rows[2999], atol=1e-6)  # turned back by products of other shapes
    np.testing.assert_allclose(rows[10:20], np.asarray(rows)[10:20], atol=1e-6)
    assert len(rows) == 3000 and rows.nbytes == 3000 * 64 and rows.filename is None


def test_the_rotation_is_orthogonal_fixed_by_its_seed_and_read_only():
    turn = vec.rotation(48)
    assert turn.dtype == np.float32 and turn.shape == (48, 48) and not turn.flags.writeable
    np.testing.assert_allclose(turn @ turn.T, np.eye(48), atol=1e-5)
    again = vec.rotation.__wrapped__(48)  # computed again, not the cached copy
    np.testing.assert_array_equal(again, turn)
    assert not np.allclose(vec.rotation.__wrapped__(48, 1), turn)  # another seed, another rotation
    assert not np.allclose(np.abs(turn), np.eye(48), atol=0.5)  # not a permutation: every dim mixed


def test_half_a_step_of_each_turned_range_bounds_a_value_and_an_inner_product_and_outside_values_are_clipped():
    rng = np.random.default_rng(1)
    x = _unit(rng, 4000)
    turned = x @ vec.rotation(64)  # (N, D) what the codes cut
    params = SQ8Rows.fit(x)
    vmin, width = params[:64], params[64:]
    assert np.allclose(vmin, turned.min(0)) and np.allclose(width, turned.max(0) - turned.min(0))
    store = SQ8Rows(np.empty((0, 64), np.uint8), params)
    back = store.decode(store.encode(x))  # (N, D) turned back
    step = width / 255
    turned_back = back @ vec.rotation(64)
    assert (np.abs(turned_back - turned) <= step / 2 + 1e-5).all() and np.abs(turned_back - turned).max() > step.min() / 4
    assert (np.linalg.norm(back - x, axis=1) <= np.linalg.norm(step / 2) + 1e-5).all()  # a rotation keeps lengths
    q = _unit(rng, 100)
    bound = np.abs(q @ vec.rotation(64)) @ (step / 2)  # (Q,) each query's largest change of a score
    assert (np.abs(q @ x.T - q @ back.T) <= bound[:, None] + 1e-5).all()
    far = np.full((1, 64), 10.0, np.float32) @ vec.rotation(64).T  # beyond every turned range: clipped, not wrapped
    np.testing.assert_allclose(store.decode(store.encode(far))[0] @ vec.rotation(64), vmin + width, atol=step.max())


def test_the_rotation_keeps_rows_whose_mass_sits_in_a_few_dimensions_closer_than_the_same_codes_without_it():
    """Each row mostly in one of 64 dimensions: every dimension's range spans [~0, ~1] while most of its values sit
    near 0, so steps of 1/255 of it are coarse; turned, every dimension holds a bit of every row."""
    rng = np.random.default_rng(3)
    x = 0.05 * rng.standard_normal((4000, 64)).astype(np.float32)
    x[np.arange(4000), rng.integers(0, 64, 4000)] += 1.0
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    store = SQ8Rows(np.empty((0, 64), np.uint8), SQ8Rows.fit(x))
    plain = faiss.ScalarQuantizer(64, faiss.ScalarQuantizer.QT_8bit)
    plain.train(x)
    turned = np.linalg.norm(store.decode(store.encode(x)) - x, axis=1).mean()
    unturned = np.linalg.norm(plain.decode(plain.compute_codes(x)) - x, axis=1).mean()
    assert turned < 0.8 * unturned, (turned, unturned)


def test_no_rows_fit_empty_ranges_and_one_row_decodes_to_itself():
    assert SQ8Rows.fit(np.zeros((0, 4), np.float32)).tolist() == [0.0] * 8  # a side with no rows (no captions)
    one = np.array([[0.5, -0.25, 0.0, 1.0]], np.float32)
    store = SQ8Rows(np.empty((0, 4), np.uint8), SQ8Rows.fit(one))
    np.testing.assert_allclose(store.decode(store.encode(one)), one, atol=1e-6)  # ranges of width 0: the value


def test_ranges_of_the_wrong_size_or_not_finite_are_refused():
    codes = np.zeros((3, 4), np.uint8)
    with pytest.raises(ValueError, match="8 finite numbers"):
        SQ8Rows(codes, np.zeros(6, np.float32))
    with pytest.raises(ValueError, match="8 finite numbers"):
        SQ8Rows(codes, np.r_[np.zeros(7), np.nan].astype(np.float32))


def test_auto_tries_float32_then_float16_then_sq8_and_says_what_none_would_need(tmp_path):
    rows, dim = 1_000_000, 256  # float32 1.024 GB, float16 0.512, sq8 0.256
    assert stored_dtype("auto", rows, dim, tmp_path, free=GB // 2) == "sq8"
    assert stored_dtype("auto", rows, dim, tmp_path, free=GB) == "float16"
    assert stored_dtype("sq8", rows, dim, tmp_path, free=2 * GB) == "sq8"
    with pytest.raises(UserError, match=r"or 0\.3 GB as sq8 on disk.* 0\.1 GB free"):
        stored_dtype("auto", rows, dim, tmp_path, free=GB // 10)


def test_a_disk_read_re_rank_of_sq8_codes_scores_the_decoded_rows(tmp_path):
    """What a served re-rank from disk reads: the codes' file through a DiskRows, decoded, as in memory."""
    rng = np.random.default_rng(2)
    x = _unit(rng, 2000)
    store = SQ8Rows(np.empty((0, 64), np.uint8), SQ8Rows.fit(x))
    np.save(tmp_path / "v.npy", store.encode(x))
    on_disk = store.with_codes(DiskRows(tmp_path / "v.npy"))
    decoded = store.decode(np.load(tmp_path / "v.npy"))  # (N, D)
    q = _unit(rng, 5)
    candidates = np.sort(rng.choice(2000, (5, 300)), 1)
    want = rerank(decoded, q, candidates, 10)  # the rows turned back, scored as float rows
    for source in (on_disk, store.with_codes(np.load(tmp_path / "v.npy", mmap_mode="r"))):
        for one in range(5):  # one query, as served (scored turned: the query turned once)
            got = rerank_from(source, q[one : one + 1], candidates[one : one + 1], 10)
            np.testing.assert_array_equal(got[1], want[1][one : one + 1])
            np.testing.assert_allclose(got[0], want[0][one : one + 1], atol=1e-5)
        np.testing.assert_allclose(rerank_from(source, q, candidates, 10)[0], want[0], atol=1e-5)


@pytest.fixture(scope="module")
def builds(emb, tmp_path_factory):  # noqa: F811
    """The same embeddings built with float32 and with sq8 vectors, with codes of 8 B re-ranked by them."""
    root = tmp_path_factory.mktemp("sq8")
    for dtype in ("float32", "sq8"):
        build_index(IndexBuildConfig(embeddings=str(emb), out=str(root / dtype), dims=[8], bytes=[8], factory="Flat",
                                     vectors=dtype))
    return root


def test_an_sq8_build_records_its_ranges_quarters_the_files_and_answers_as_float32_does(builds):
    folders = {d: builds / d / current_version(builds / d) for d in ("float32", "sq8")}
    manifest = json.loads((folders["sq8"] / MANIFEST).read_text())
    dim = manifest["dim"]
    assert manifest["vectors_dtype"] == "sq8" and sorted(manifest["vectors_sq8"]) == ["image", "rotation_seed", "text"]
    assert manifest["vectors_sq8"]["rotation_seed"] == vec.SQ8_ROTATION_SEED
    assert all(len(manifest["vectors_sq8"][k]) == 2 * dim for k in ("image", "text"))
    for name in ("vectors.npy", "text_vectors.npy"):
        small, full = ((folders[d] / name).stat().st_size for d in ("sq8", "float32"))
        assert small < 0.26 * full and np.load(folders["sq8"] / name, mmap_mode="r").dtype == np.uint8
    reranks = [c for c in json.loads((folders["sq8"] / "curves.json").read_text())["bytes"]["candidates"]["8"]
               if c.get("shortlist")]
    assert reranks and all(c["disk_bytes_per_query"] == dim * c["shortlist"] for c in reranks)
    a, b = Searcher.load(builds / "float32"), Searcher.load(builds / "sq8")
    assert isinstance(b.contents.vectors, SQ8Rows) and isinstance(b.contents.text_vectors, SQ8Rows)
    step = np.asarray(manifest["vectors_sq8"]["image"][dim:]) / 255
    ids = [row["id"] for row in a.contents.meta[:30]]
    assert b.vectors_of(ids).dtype == np.float32
    over = np.linalg.norm(b.vectors_of(ids) - a.vectors_of(ids), axis=1) - np.linalg.norm(step / 2)  # (30,)
    assert over.max() <= 1e-5, over.max()  # half a step of each turned range, turned back
    queries = np.asarray(a.contents.text_vectors[:40], np.float32)  # (40, D)
    for how in ({"funnel": 8}, {"bytes": 8, "rescore": "float"}, {}, {"target": "text"}):
        want, got = a.search_vectors(queries, k=5, **how), b.search_vectors(queries, k=5, **how)
        assert np.mean([w[0]["id"] == g[0]["id"] for w, g in zip(want, got)]) >= 0.9
        assert np.mean([len({h["id"] for h in w} & {h["id"] for h in g}) / 5 for w, g in zip(want, got)]) >= 0.8
    assert [h["id"] for h in b.search_ids(ids[:5], k=1)[0]] == ids[:1]  # an image finds itself first


def test_a_stage_that_reads_sq8_rows_from_disk_decodes_them_through_a_diskrows_with_the_answers_from_memory(builds):
    searcher = Searcher.load(builds / "sq8")
    queries = np.asarray(searcher.contents.text_vectors[:25])
    stage = {"with": "float", "shortlist": 40, "shortlist_how": "measured", "disk_bytes_per_query": 0}
    answers = {}
    for reads in ("memory", "disk"):
        searcher.contents.manifest["budgets"]["8"]["rescore"] = {**stage, "reads": reads}
        answers[reads] = searcher.search_vectors(queries, k=5, bytes=8)
        assert bool(searcher._rows_on_disk) == (reads == "disk")
    assert answers["disk"] == answers["memory"]
    on_disk = next(iter(searcher._rows_on_disk.values()))
    assert isinstance(on_disk, SQ8Rows) and isinstance(on_disk.codes, DiskRows)


def test_a_manifest_without_the_ranges_or_the_rotation_or_with_a_float_file_is_refused_in_one_line(builds, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(builds / "sq8", copy)
    manifest_file = copy / current_version(copy) / MANIFEST
    manifest = json.loads(manifest_file.read_text())
    entry = manifest["vectors_sq8"]
    for broken, why in (({k: v for k, v in manifest.items() if k != "vectors_sq8"}, "lacks rotation_seed 0"),
                        ({**manifest, "vectors_sq8": {**entry, "image": entry["image"][:-1]}},
                         "lacks the image vectors' ranges"),
                        ({**manifest, "vectors_sq8": {**entry, "rotation_seed": 1}}, "lacks rotation_seed 0"),
                        ({**manifest, "vectors_sq8": {k: v for k, v in entry.items() if k != "rotation_seed"}},
                         "lacks rotation_seed 0")):
        manifest_file.write_text(json.dumps(broken))
        with pytest.raises(UserError, match=f"manifest.json's vectors_sq8 {why}") as err:
            load_contents(copy)
        assert "\n" not in str(err.value)
    other = tmp_path / "other"
    shutil.copytree(builds / "float32", other)
    manifest_file = other / current_version(other) / MANIFEST
    manifest_file.write_text(json.dumps({**json.loads(manifest_file.read_text()), "vectors_dtype": "sq8",
                                         "vectors_sq8": manifest["vectors_sq8"]}))
    with pytest.raises(UserError, match=r"vectors.npy holds float32 .* expected sq8"):
        load_contents(other)


def test_the_milvus_export_reads_sq8_rows_decoded(builds):
    folder = builds / "sq8" / current_version(builds / "sq8")
    manifest = json.loads((folder / MANIFEST).read_text())
    codes = np.load(folder / "vectors.npy")
    ranges = _ranges(manifest, "image", codes.shape[1], lambda what: UserError(what))
    rows = _mapped(folder / "vectors.npy", codes.shape, lambda what: UserError(what), ranges)
    got = rows[3:11]
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, SQ8Rows(codes, ranges)[3:11])
    with pytest.raises(UserError, match=r"holds uint8 .* expected float32 or float16"):
        _mapped(folder / "vectors.npy", codes.shape, lambda what: UserError(what))
    with pytest.raises(UserError, match=r"vectors_sq8 lacks rotation_seed 0"):  # codes of another rotation
        _ranges({**manifest, "vectors_sq8": {**manifest["vectors_sq8"], "rotation_seed": 7}}, "image",
                codes.shape[1], lambda what: UserError(what))


def test_auto_keeps_sq8_when_float16_would_not_fit_and_says_so(emb, tmp_path, monkeypatch, capsys):  # noqa: F811
    probe = load_contents(_build(emb, tmp_path / "probe", "float32"))
    need32 = 4 * probe.vectors.shape[1] * (len(probe.vectors) + len(probe.text_vectors))
    Usage = namedtuple("Usage", "total used free")  # the free disk given: between sq8's size and float16's
    monkeypatch.setattr(vec.shutil, "disk_usage", lambda where: Usage(0, 0, need32 * 3 // 8))
    capsys.readouterr()
    assert load_contents(_build(emb, tmp_path / "auto", "auto")).manifest["vectors_dtype"] == "sq8"
    said = [line for line in capsys.readouterr().err.splitlines() if "full-D vectors are kept" in line]
    assert said == [f"the full-D vectors are kept as sq8 (1 B a dimension): float32 would not fit in the free disk"
                    f" of {tmp_path}"]
    capsys.readouterr()
    _build(emb, tmp_path / "asked", "sq8")  # asked for: nothing to say
    assert "full-D vectors are kept" not in capsys.readouterr().err


def _build(emb, out, dtype: str):  # noqa: F811
    build_index(IndexBuildConfig(embeddings=str(emb), out=str(out), vectors=dtype))
    return out


def test_add_keeps_the_index_sq8_in_its_own_ranges(tmp_path, run_dir, shapes_dir):
    from tests.index.conftest import split_manifest

    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    split_manifest(shapes_dir / "train.jsonl", first, second, at=50)
    out = tmp_path / "grown"
    common = dict(run=str(run_dir), out=str(out), factory="Flat")
    build_index(IndexBuildConfig(data=str(first), vectors="sq8", **common))
    before = load_contents(out)
    with pytest.raises(UserError, match="--vectors do not apply"):
        build_index(IndexBuildConfig(data=str(second), add=True, vectors="float32", **common))
    summary = build_index(IndexBuildConfig(data=str(second), add=True, **common))
    grown = load_contents(out)
    assert summary["added"] == len(grown.vectors) - 50 > 0 and grown.manifest["vectors_dtype"] == "sq8"
    assert grown.manifest["vectors_sq8"] == before.manifest["vectors_sq8"]  # not refitted
    np.testing.assert_array_equal(np.asarray(grown.vectors.codes[:50]), np.asarray(before.vectors.codes))
    searcher = Searcher.load(out)
    last = grown.meta[-1]["id"]
    assert [h["id"] for h in searcher.search_ids([last], k=1)[0]] == [last]  # an added image finds itself


def test_a_resumed_build_reads_the_precision_of_the_vectors_file_it_left(tmp_path):
    from triclip.index.build import _vectors_dtype

    for dtype, stored in (("sq8", np.uint8), ("float16", np.float16), ("float32", np.float32)):
        work = tmp_path / dtype
        work.mkdir()
        np.save(work / "vectors.npy", np.zeros((3, 4), stored))
        assert _vectors_dtype(None, None, work) == dtype
