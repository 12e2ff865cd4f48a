"""Compact features against their definitions (docs/CONTRACT.md "Compact features")."""

from __future__ import annotations

import json
import math
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from triclip.compact.features import (
    ORDERINGS,
    CompactTransform,
    compact_curve,
    compact_embeddings,
    fit_pca,
    importance_order,
    make_transform,
    sign_flips,
    topm_embed,
)

D = 12


def _unit(n: int, d: int = D, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(n, d, generator=gen, dtype=torch.float64), dim=-1)


def _importance(seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(D, generator=gen, dtype=torch.float64) * 2


def _t2i_r10_reference(img: torch.Tensor, txt: torch.Tensor, t2i: torch.Tensor) -> float:
    """Slow loop: a text is a hit when fewer than 10 other images score at least as high as its own."""
    hits = 0
    for j in range(txt.shape[0]):
        scores = [float(txt[j] @ img[i]) for i in range(img.shape[0])]
        own = int(t2i[j])
        rivals = sum(1 for i, s in enumerate(scores) if s >= scores[own] and i != own)
        hits += rivals < 10
    return hits / txt.shape[0]


# ---------------------------------------------------------------------------- order / top-m


def test_importance_order_is_descending_argsort_with_stable_ties():
    w = torch.tensor([0.2, 0.9, 0.2, 0.5, 0.9])
    assert importance_order(w).tolist() == [1, 4, 3, 0, 2]
    assert importance_order(None, dim=4).tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError):
        importance_order(torch.tensor([0.1, -0.2]))
    with pytest.raises(ValueError):
        importance_order(None)


@pytest.mark.parametrize("m", [1, 5, D])
def test_topm_embed_matches_definition(m):
    z, w = _unit(7), _importance()
    order = importance_order(w)
    got = topm_embed(z, w, order, m)
    assert got.shape == (7, m)
    for i in range(7):
        row = [math.sqrt(float(w[order[j]])) * float(z[i, order[j]]) for j in range(m)]
        norm = math.sqrt(sum(v * v for v in row))
        for j in range(m):
            assert got[i, j].item() == pytest.approx(row[j] / norm, abs=1e-12)


def test_topm_at_full_dim_ranks_like_trifactor_similarity():
    img, txt, w = _unit(9, seed=2), _unit(6, seed=3), _importance()
    order = importance_order(w)
    ci, ct = topm_embed(img, w, order, D), topm_embed(txt, w, order, D)
    trifactor = (img * w) @ txt.T  # (9, 6)
    norms = (img * w.sqrt()).norm(dim=1)[:, None] * (txt * w.sqrt()).norm(dim=1)[None, :]
    torch.testing.assert_close(ci @ ct.T * norms, trifactor)


def test_topm_rejects_bad_m():
    z, w = _unit(3), _importance()
    for m in (0, D + 1):
        with pytest.raises(ValueError):
            topm_embed(z, w, importance_order(w), m)


# ---------------------------------------------------------------------------- sign fix


def test_sign_flips_follow_first_nonzero_anchor():
    feats = torch.tensor(
        [
            [0.0, -1.0, 0.0, 2.0],
            [-3.0, 4.0, 0.0, -1.0],
            [5.0, 1.0, 0.0, 1.0],
        ]
    )
    assert sign_flips(feats, "anchor").tolist() == [-1.0, -1.0, 1.0, 1.0]


def test_sign_fix_leaves_every_score_unchanged_and_makes_anchors_positive():
    img, txt = _unit(20, seed=4), _unit(15, seed=5)
    signs = sign_flips(img, "anchor")
    fi, ft = img * signs, txt * signs
    torch.testing.assert_close(fi @ ft.T, img @ txt.T)
    assert (fi[0] > 0).all()  # random data: row 0 is every dimension's anchor
    # comparable across runs: a run whose dims came out negated gets the same features back
    flipped = torch.where(torch.arange(D) % 3 == 0, -1.0, 1.0).double()
    torch.testing.assert_close((img * flipped) * sign_flips(img * flipped, "anchor"), fi)


def test_transform_sign_fix_keeps_scores():
    img, txt, w = _unit(10, seed=6), _unit(8, seed=7), _importance()
    for name in ORDERINGS:
        t = make_transform(name, D, 5, w, pca_feats=torch.cat([img, txt]))
        s = t.with_signs_from(img)
        torch.testing.assert_close(s(img) @ s(txt).T, t(img) @ t(txt).T)
        assert (s(img)[0] > 0).all()  # indexes keep the one-anchor rule (the default)


# ---------------------------------------------------------------------------- PCA


def test_fit_pca_matches_svd_of_centred_data():
    x = _unit(50, seed=8) * torch.linspace(2.0, 0.1, D, dtype=torch.float64)
    basis = fit_pca(x)
    centred = x - x.mean(0)
    _, s, vh = torch.linalg.svd(centred, full_matrices=False)
    torch.testing.assert_close(basis.variances, s**2 / (x.shape[0] - 1))
    torch.testing.assert_close(basis.components @ basis.components.T, torch.eye(D, dtype=torch.float64))
    # same directions up to sign
    torch.testing.assert_close((basis.components * vh).sum(1).abs(), torch.ones(D, dtype=torch.float64))
    assert (basis.variances[:-1] >= basis.variances[1:]).all()
    torch.testing.assert_close(basis.project(x, D) @ basis.components + basis.mean, x)


def test_uncentred_pca_at_full_dim_keeps_scores():
    img, txt = _unit(10, seed=9), _unit(7, seed=10)
    basis = fit_pca(torch.cat([img, txt]), center=False)
    ci, ct = compact_embeddings(img, txt, "pca", D, pca_fit=basis)
    torch.testing.assert_close(ci @ ct.T, img @ txt.T)


# ---------------------------------------------------------------------------- orderings


def test_baselines_use_the_plain_embedding():
    img, txt, w = _unit(6, seed=11), _unit(5, seed=12), _importance()
    ci, ct = compact_embeddings(img, txt, "first", 4, importance=w)
    torch.testing.assert_close(ci, F.normalize(img[:, :4], dim=-1))
    torch.testing.assert_close(ct, F.normalize(txt[:, :4], dim=-1))
    weighted, _ = compact_embeddings(img, txt, "first", 4, importance=w, weighted=True)
    torch.testing.assert_close(weighted, F.normalize(img[:, :4] * w[:4].sqrt(), dim=-1))
    # random: seeded, nested in m, a permutation at m = D (scores unchanged there)
    r4, _ = compact_embeddings(img, txt, "random", 4, seed=3)
    r6, _ = compact_embeddings(img, txt, "random", 6, seed=3)
    perm = torch.randperm(D, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(r4, F.normalize(img[:, perm[:4]], dim=-1))
    torch.testing.assert_close(r6, F.normalize(img[:, perm[:6]], dim=-1))
    assert not torch.equal(r4, compact_embeddings(img, txt, "random", 4, seed=4)[0])
    fi, ft = compact_embeddings(img, txt, "random", D, seed=3)
    torch.testing.assert_close(fi @ ft.T, img @ txt.T)
    # importance without importance = first-m
    torch.testing.assert_close(compact_embeddings(img, txt, "importance", 4)[0], ci)


def test_importance_ordering_equals_topm_embed():
    img, txt, w = _unit(6, seed=13), _unit(5, seed=14), _importance()
    ci, ct = compact_embeddings(img, txt, "importance", 3, importance=w)
    torch.testing.assert_close(ci, topm_embed(img, w, importance_order(w), 3))
    torch.testing.assert_close(ct, topm_embed(txt, w, importance_order(w), 3))


def test_pca_ordering_fits_on_joint_embeddings_by_default():
    img, txt = _unit(8, seed=15), _unit(6, seed=16)
    ci, ct = compact_embeddings(img, txt, "pca", 3)
    basis = fit_pca(torch.cat([img, txt]))
    torch.testing.assert_close(ci, F.normalize((img - basis.mean) @ basis.components[:3].T, dim=-1))
    torch.testing.assert_close(ct, F.normalize((txt - basis.mean) @ basis.components[:3].T, dim=-1))


def test_transform_json_round_trip():
    img, w = _unit(5, seed=17), _importance()
    for name in ORDERINGS:
        t = make_transform(name, D, 4, w, pca_feats=img).with_signs_from(img)
        back = CompactTransform.from_dict(json.loads(json.dumps(t.to_dict())))
        assert back.ordering == name and back.m == 4
        torch.testing.assert_close(back(img.float()), t(img.float()))


def test_bad_settings_fail_early():
    img, txt = _unit(4), _unit(4)
    with pytest.raises(ValueError, match="ordering"):
        compact_embeddings(img, txt, "magnitude", 2)
    with pytest.raises(ValueError, match="m must be"):
        compact_embeddings(img, txt, "first", D + 1)
    with pytest.raises(ValueError, match="dimension"):
        compact_embeddings(img, txt[:, :5], "first", 2)
    with pytest.raises(ValueError, match="entries"):
        compact_embeddings(img, txt, "importance", 2, importance=torch.ones(D - 1))
    with pytest.raises(ValueError):
        CompactTransform("first", D, 2, keep=torch.arange(3))


# ---------------------------------------------------------------------------- curve


@pytest.fixture
def metrics_module(monkeypatch):
    """``triclip.compact.metrics`` if it exists, otherwise a stand-in built on the reference loop."""
    try:
        import triclip.compact.metrics  # noqa: F401
    except ImportError:
        fake = types.ModuleType("triclip.compact.metrics")
        fake.retrieval_recall = lambda i, t, t2i, **_: {"t2i_r10": _t2i_r10_reference(i, t, t2i)}
        monkeypatch.setitem(sys.modules, "triclip.compact.metrics", fake)


def test_compact_curve_matches_reference_recall(metrics_module):
    gen = torch.Generator().manual_seed(18)
    img = _unit(40, seed=19)
    t2i = torch.arange(40).repeat(2)  # two captions per image
    txt = F.normalize(img[t2i] + 0.9 * torch.randn(80, D, generator=gen, dtype=torch.float64), dim=-1)
    w = _importance()
    curve = compact_curve(img, txt, t2i, w, dims=[2, 6, D])
    assert set(curve) == {"importance", "first", "random", "pca"}
    basis = fit_pca(torch.cat([img, txt]))
    for name, row in curve.items():
        assert list(row) == [2, 6, D]
        for m, value in row.items():
            ci, ct = compact_embeddings(img, txt, name, m, importance=w, pca_fit=basis)
            assert value == pytest.approx(_t2i_r10_reference(ci, ct, t2i))
    assert curve["first"][D] == pytest.approx(curve["random"][D])  # both are plain cosine at m = D
    with pytest.raises(ValueError):
        compact_curve(img, txt, t2i, w, dims=[D + 1])


# ---------------------------------------------------------------------------- suggest_m


def test_suggest_m_on_synthetic_spectra():
    from triclip.compact.features import suggest_m

    # share of w itself (power 1): 0.9 of the total in the first dimension
    w = torch.tensor([9.0, 0.25, 0.25, 0.25, 0.25])
    assert suggest_m(w, share=0.9, power=1.0) == 1
    assert suggest_m(w, share=0.95, power=1.0) == 3  # 9.5 / 10 after three
    assert suggest_m(w.flip(0), share=0.9, power=1.0) == 1  # only the sorted spectrum counts
    # the default is the share of w^2 (of the Eq. 6 objective): 81 / 81.25 in the first dimension
    assert suggest_m(w, share=0.99) == 1
    assert suggest_m(torch.tensor([1.0, 1.0, 0.5, 0.5]), share=0.8) == 2  # (1 + 1) / 2.5 = 0.8
    # a flat spectrum predicts a share of D, whatever the power
    assert suggest_m(torch.ones(64), share=0.5) == 32
    assert suggest_m(None, share=0.5, dim=64) == 32
    # geometric spectrum: smallest m with cumulative share of w^2 >= 0.9, from a slow loop
    g = 0.9 ** torch.arange(32, dtype=torch.float64)
    total, acc, want = float((g**2).sum()), 0.0, None
    for k, v in enumerate(g.tolist(), 1):
        acc += v * v
        if acc / total >= 0.9:
            want = k
            break
    assert suggest_m(g, share=0.9) == want < suggest_m(g, share=0.9, power=1.0)
    assert suggest_m(g, share=1.0) == 32
    with pytest.raises(ValueError):
        suggest_m(g, share=0.0)


# ---------------------------------------------------------------------------- sign rules


@pytest.mark.parametrize("rule", ["anchor", "majority", "skew"])
def test_every_sign_rule_is_invariant_to_input_flips_and_keeps_scores(rule):
    gen = torch.Generator().manual_seed(8)
    img = torch.randn(50, D, generator=gen, dtype=torch.float64).exp() - 1.0  # skewed coordinates
    txt = torch.randn(30, D, generator=gen, dtype=torch.float64)
    signs = sign_flips(img, rule)
    torch.testing.assert_close((img * signs) @ (txt * signs).T, img @ txt.T)
    for pattern in range(1, 8):  # flip any subset of dimensions on input: the fixed features do not change
        flips = torch.tensor([-1.0 if (d * pattern) % 3 == 0 else 1.0 for d in range(D)], dtype=torch.float64)
        torch.testing.assert_close((img * flips) * sign_flips(img * flips, rule), img * signs)


def test_skew_and_majority_rules_follow_their_statistics():
    feats = torch.tensor([[0.1, -0.1], [-1.0, 1.0], [-1.0, 1.0], [-1.0, 1.0], [5.0, -5.0]])
    # anchor: row 0; majority: most rows; skew: the long tail (the 5) goes positive
    assert sign_flips(feats, "anchor").tolist() == [1.0, -1.0]
    assert sign_flips(feats, "majority").tolist() == [-1.0, 1.0]
    assert sign_flips(feats, "skew").tolist() == [1.0, -1.0]
    with pytest.raises(ValueError, match="sign rule"):
        sign_flips(feats, "median")


def test_skew_rule_agrees_across_data_halves_where_the_anchor_rule_does_not():
    # skewed coordinates with many values near zero: the first row of each half decides the
    # anchor rule by chance, the third moment is a property of the distribution
    gen = torch.Generator().manual_seed(9)
    feats = torch.randn(4000, 64, generator=gen, dtype=torch.float64).exp() - 1.5  # skew > 0, mean ~ 0.15
    a, b = feats[:2000], feats[2000:]
    skew_agree = (sign_flips(a, "skew") == sign_flips(b, "skew")).double().mean()
    anchor_agree = (sign_flips(a, "anchor") == sign_flips(b, "anchor")).double().mean()
    assert skew_agree == 1.0
    assert anchor_agree < 0.8
