"""benchmarks.haystack and its density: streamed, seeded draws; shards that land where queries.jsonl says."""

import json
import os

import numpy as np
import pytest

from benchmarks import haystack as hs
from benchmarks import haystack_density as hd
from triclip.index.val_embeddings import validation_set
from triclip.index.vectors import ShardVectors
from triclip.model.shards import check_complete, load_shard

D = 16


def unit(x):
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def collection(n=300, seed=0) -> hs.Split:
    """Clustered images, one caption each (its image plus noise), split 60/20/20 by row."""
    rng = np.random.default_rng(seed)
    centres = unit(rng.normal(size=(30, D)))
    image = unit(centres[rng.integers(0, 30, n)] + 0.35 * rng.normal(size=(n, D))).astype(np.float32)
    text = unit(image + 0.4 * rng.normal(size=(n, D))).astype(np.float32)
    meta = [{"id": str(i), "image": f"/d/{i}.png", "captions": [f"caption {i}"], "label": None} for i in range(n)]
    cut = [0, int(0.6 * n), int(0.8 * n), n]
    rows = {s: np.arange(cut[j], cut[j + 1]) for j, s in enumerate(hs.SPLITS)}
    manifest = {"run": "r", "fingerprint": "f", "importance": list(range(D)), "transform": {"ordering": "importance", "dim": D, "m": D, "signs": None}}
    return hs.Split(image, text, np.stack([np.arange(n), np.zeros(n, int)], 1), meta, rows, manifest)


@pytest.fixture(scope="module")
def model():
    return hd.fit(collection().image[:200])


def test_a_row_depends_on_seed_and_number_only(model, monkeypatch):
    monkeypatch.setattr(hd, "BLOCK", 64)  # several random blocks in 500 rows
    small = list(hd.sample(model, 500, seed=3, chunk=37))
    assert {len(c) for c in small[:-1]} == {37} and len(small[-1]) == 500 % 37  # chunks of the size asked
    whole = np.concatenate(small)
    assert np.array_equal(whole, np.concatenate(list(hd.sample(model, 500, seed=3, chunk=500))))
    assert np.array_equal(whole[:130], np.concatenate(list(hd.sample(model, 130, seed=3, chunk=64))))  # a prefix
    assert np.array_equal(hd.rows(model, 3, np.array([499, 7, 64])), whole[[499, 7, 64]])
    assert not np.allclose(whole, np.concatenate(list(hd.sample(model, 500, seed=4, chunk=37))))
    assert np.allclose(np.linalg.norm(whole, axis=1), 1, atol=1e-5)


def test_draws_lie_between_a_vector_and_a_neighbour_nearer_its_own(model):
    model.t_min = 0.2
    x = hd.draws(model, 400, 0)
    best = hd.knn(x, model.centres, 2)[0]  # (n, 2)
    assert (best[:, 0] < 1 - 1e-4).all()  # never a copy of a fitted vector
    assert (best[:, 0] > 0.5).all()


def test_t_min_is_recovered_from_a_near_copy_rate(model):
    """Held-out vectors drawn at a known t_min: the bisection finds that t_min from their near-copy rate."""
    cfg = hd.DensityConfig(near=0.97, steps=14)
    for t0 in (0.1, 0.3):
        model.k, model.t_min = 16.0, t0
        target = hd.near_rate(hd.draws(model, 4000, seed=9), model.centres, cfg.near)
        model.t_min = 0.0
        hd._fit_t_min(model, target, cfg)
        assert abs(model.t_min - t0) < 0.04, (t0, model.t_min)


def test_k_is_where_recall_crosses_the_real_one():
    ks, recalls = [16, 32, 64, 128], [0.1, 0.2, 0.3, 0.4]
    assert hd._crossing(ks, recalls, 0.25) == pytest.approx(np.sqrt(32 * 64))
    assert hd._crossing(ks, recalls, 0.9) == 128  # no crossing: the nearest


def test_calibration_matches_the_held_out_near_copy_rate_and_recall():
    sp = collection(600)
    m = hs.fit_image(sp)
    cal = m.calibration
    assert abs(cal["near_rate_draws"] - cal["near_rate_held_out"]) < 0.03
    assert 0 < m.t_min < m.t_max and 16 <= m.k <= m.partners.shape[1]
    rec = [r for k, _, r, _ in cal["grid"]]
    assert min(rec) - 0.05 <= cal["recall_real"] <= max(rec) + 0.05


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    sp, out = collection(), tmp_path_factory.mktemp("h") / "out"
    cfg = hs.BuildConfig("INDEX", "DATA", str(out), n=250, seed=1, shard_size=70, text=True)
    return sp, cfg, hs.build(cfg, sp), out


def test_the_test_rows_and_their_queries_land_where_queries_jsonl_says(built):
    sp, cfg, summary, out = built
    emb = out / "embeddings"
    manifest = check_complete(emb)  # the project's reader: every shard whole
    assert manifest["records"] == 250 and manifest["num_shards"] == 4 and summary["distractors"] == 250 - 60
    assert ShardVectors.open(str(emb), manifest["num_shards"], "image").count == 250
    queries = np.load(out / "queries.npy")
    lines = [json.loads(line) for line in (out / "queries.jsonl").read_text().splitlines()]
    assert len(lines) == len(queries) == 60
    for q, line in zip(queries, lines):
        (row,) = line["targets"]
        shard = load_shard(emb, row // 70)
        assert line["text"] in shard["meta"][row % 70]["captions"]
        assert np.array_equal(shard["image"][row % 70], sp.image[sp.rows["test"][row]])
        assert np.allclose(q, sp.text[sp.rows["test"][row]])


def test_the_val_rows_are_an_evaluation_set_in_the_haystacks_space(built):
    """``val-embeddings/``: the val split's real rows, read by ``index build --val-embeddings`` as its evaluation
    set (the same run and transform as the haystack's shards: no sign to change)."""
    sp, cfg, _, out = built
    val = sp.rows["val"]
    manifest = check_complete(out / "val-embeddings")
    shard = load_shard(out / "val-embeddings", 0)
    assert manifest["records"] == len(val) and np.array_equal(shard["image"], sp.image[val])
    evaluation = validation_set(str(out / "val-embeddings"), check_complete(out / "embeddings"))
    assert evaluation.split == "validation" and len(evaluation.gallery) == len(val)
    np.testing.assert_allclose(evaluation.queries, sp.text[val], atol=0)  # one distinct caption per image, in order
    assert evaluation.positives == [{j} for j in range(len(val))]


def test_distractor_rows_are_the_streams_rows_with_their_captions(built, monkeypatch):
    sp, cfg, _, out = built
    model = hs.fit_image(sp)  # fitted the same way: deterministic
    shard = load_shard(out / "embeddings", 1)  # rows 70..139: distractors 10..79
    assert np.allclose(shard["image"], hd.rows(model, cfg.seed, np.arange(10, 80)), atol=1e-6)
    assert [m["id"] for m in shard["meta"][:2]] == ["haystack-000000010", "haystack-000000011"]
    counts = np.bincount(shard["text_rows"][:, 0], minlength=70)
    assert list(counts) == [len(m["captions"]) for m in shard["meta"]] and counts.sum() == len(shard["text"])


def test_build_never_draws_more_than_a_shard_at_once(monkeypatch, tmp_path):
    sp, asked, rows = collection(), [], hd.rows
    fitted = hs.fit_image(sp)  # the calibration draws as many rows as it fits (small); the shards are drawn apart
    monkeypatch.setattr(hs, "fit_image", lambda _: fitted)
    monkeypatch.setattr(hd, "rows", lambda m, s, ids, side=0: asked.append(len(ids)) or rows(m, s, ids, side))
    hs.build(hs.BuildConfig("I", "D", str(tmp_path / "o"), n=400, shard_size=50), sp)
    assert max(asked) <= 50 and sum(asked) == 400 - 60 and len(asked) == 8


def test_an_existing_out_is_refused_without_overwrite(built, capsys):
    sp, cfg, _, out = built
    before = (out / "haystack.json").read_text()
    with pytest.raises(hs.UserError, match="--overwrite"):
        hs.build(cfg, sp)
    assert (out / "haystack.json").read_text() == before
    hs.build(hs.BuildConfig(**{**cfg.__dict__, "n": 100, "overwrite": True}), sp)
    assert check_complete(out / "embeddings")["records"] == 100


@pytest.mark.parametrize("argv", [
    ["build", "I", "--data", "D", "--out", "O", "--n", "many"],
    ["curve", "I", "--data", "D", "--codes", "PQ99"],
    ["validate", "/nonexistent/index", "--data", "D"],
])
def test_a_bad_argument_is_one_line_and_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as err:
        hs.main(argv)
    assert err.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_a_shortlist_re_ranked_with_float_is_exact_search_within_it():
    x = unit(np.random.default_rng(0).normal(size=(500, 64))).astype(np.float32)
    q = x[:20] + 0.01
    code, depth = hs.code_of("PQ32x4fs+500", 64)
    code.fit(x)
    code.add(x)
    assert np.array_equal(hs.found(code, depth, q, lambda ids: x[ids], 10), hd.knn(q, x, 10)[1])


@pytest.fixture(scope="module")
def lists_curve(tmp_path_factory):
    """``curve`` with lists as index build stores them, sized for its largest N (4,000 rows), and the rows
    written as float16."""
    sp, file = collection(), tmp_path_factory.mktemp("c") / "rows.npy"
    mp = pytest.MonkeyPatch()
    mp.setattr(hs, "read_split", lambda index, data: sp)
    from triclip.index.latency import LatencyModel

    cold, mapped = LatencyModel.cold_search, []

    def spy(self, codes, path, *args, **kwargs):  # is the rows file still mapped by the writer while it is timed?
        with open("/proc/self/maps") as fh:
            mapped.append(any(line.rstrip().endswith(str(path)) for line in fh))
        return cold(self, codes, path, *args, **kwargs)

    mp.setattr(LatencyModel, "cold_search", spy)
    cfg = hs.MeasureConfig("I", "D", seeds=[3], codes=["lists-OPQ8x8", "lists-OPQ8x8+4000"], sizes=[1000, 4000],
                           fit_rows=1000, chunk=700, nprobes=[1, 102], vectors=str(file))
    try:
        return sp, cfg, hs.curve(cfg), mapped
    finally:
        mp.undo()


def test_lists_at_n_are_refitted_for_the_largest_n_and_exact_when_every_list_and_row_is_re_ranked(lists_curve):
    sp, cfg, records, _ = lists_curve
    built = records[-1]["built"]["lists-OPQ8x8"]  # one code for both names: filled once
    assert list(records[-1]["built"]) == ["lists-OPQ8x8"]
    assert 0 < records[0]["built"]["lists-OPQ8x8"]["fill_s"] < built["fill_s"]  # each size: the fill so far
    assert built["nlist"] == 4000 // 39 and built["coarse_rows"] == 4000  # lists_for(4000) = 256, at most rows / 39
    last = records[-1]
    assert last["lists-OPQ8x8+4000 nprobe=102 of exact top 10"] == 1.0  # all lists, every row re-ranked: exact
    assert last["lists-OPQ8x8+4000 nprobe=102"] == last["float"]
    assert last["lists-OPQ8x8 nprobe=1 of exact top 10"] < last["lists-OPQ8x8 nprobe=102 of exact top 10"] < 1.0
    for key in [f"lists-OPQ8x8{d} nprobe={p}" for d in ("", "+4000") for p in (1, 102)]:  # a found exact top-10
        assert last[f"{key} of exact top 10"] <= last[f"{key} within 0.001"] <= last[f"{key} within 0.01"] <= 1.0
    assert last["lists-OPQ8x8 nprobe=102 within 0.01"] > last["lists-OPQ8x8 nprobe=102 of exact top 10"]  # near-ties
    assert [r["n"] for r in records] == [1000, 4000]
    assert 0 < records[0]["anon_peak_mib"] <= last["anon_peak_mib"] < 64 * 1024  # the peak so far, MiB


def test_lists_are_timed_and_the_rows_file_holds_the_haystack_as_float16(lists_curve):
    sp, cfg, records, _ = lists_curve
    last = records[-1]
    assert all(last[f"lists-OPQ8x8{d} nprobe={p} ms codes"] > 0 for d in ("", "+4000") for p in (1, 102))
    assert last["lists-OPQ8x8+4000 nprobe=102 ms cold"] > 0 and "lists-OPQ8x8 nprobe=102 ms cold" not in last
    rows = np.load(cfg.vectors)
    model = hs.fit_image(sp)
    expected = hs.haystack_rows(sp.image[sp.rows["test"]], model, 3, np.arange(4000)).astype(np.float16)
    assert rows.dtype == np.float16 and np.array_equal(rows, expected)
    assert not os.path.exists(cfg.vectors + ".tmp")


def test_the_rows_file_is_not_mapped_while_a_re_rank_is_timed_cold(lists_curve):
    """A page the writer still maps is not evicted, so a "cold" read of it would be warm: the map is dropped before
    each size is measured (and reopened for the next size's rows)."""
    *_, mapped = lists_curve
    assert len(mapped) == 2 * 2 and not any(mapped)  # 2 sizes x 2 nprobes, the +4000 code only


def test_the_rows_file_is_never_replaced(lists_curve, monkeypatch):
    sp, cfg, _, _ = lists_curve
    monkeypatch.setattr(hs, "read_split", lambda index, data: sp)
    before = os.path.getmtime(cfg.vectors)
    with pytest.raises(hs.UserError, match="exists"):
        hs.curve(cfg)
    assert os.path.getmtime(cfg.vectors) == before
