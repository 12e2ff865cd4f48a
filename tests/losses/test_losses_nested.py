"""The nesting wrapper (Matryoshka) around every objective, against a slow loop from its definition."""

from __future__ import annotations

import pytest
import torch

from triclip.losses import LossConfigError, Nested, available_losses, build_loss
from tests.losses.test_losses_reference import CASES, _grads, _inputs, ref_infonce


def ref_compact(z, w, keep):
    """Rows of ``z`` (``sqrt(w) * z`` when ``w`` is given) restricted to ``keep``, each divided by its norm."""
    rows = []
    for k in range(len(z)):
        v = torch.stack([z[k, d] * (1.0 if w is None else torch.sqrt(w[d])) for d in keep])
        rows.append(v / torch.sqrt(sum(x * x for x in v)))
    return torch.stack(rows)


def ref_nested_term(image, text, s, w, levels, weight, order):
    """weight * sum over m = D/2, D/4, ..., D/2**levels (m >= 1) of InfoNCE of the compact embedding.

    ``prefix``: the first m coordinates, unweighted; ``importance``: the m of largest w (ties by
    index), weighted by sqrt(w).
    """
    d = image.shape[1]
    if order == "prefix":
        ranked, weights = list(range(d)), None
    else:
        ranked, weights = sorted(range(d), key=lambda j: (-float(w[j].detach()), j)), w
    total = 0.0
    m = d // 2
    for _ in range(levels):
        if m < 1:
            break
        keep = ranked[:m]
        total = total + ref_infonce(ref_compact(image, weights, keep), ref_compact(text, weights, keep), s)
        m //= 2
    return weight * total


WRAPPABLE = [name for name in available_losses() if name != "mrl"]  # mrl is infonce + nesting already


def _case(name):
    """The objective's first reference case, its options without nesting (each test here nests it its own way)."""
    opts, ref = next((opts, ref) for n, opts, ref in CASES if n == name)
    return {k: v for k, v in opts.items() if not k.startswith("nested")}, ref


@pytest.mark.parametrize("name", WRAPPABLE)
@pytest.mark.parametrize("order", ["prefix", "importance"])
@pytest.mark.parametrize("dim,levels", [(8, 2), (12, 3), (4, 5)])
def test_wrapper_matches_reference_loop(name, order, dim, levels):
    """Every objective + nested term == the objective's loop + the nested loop, values and grads (float64)."""
    opts, ref = _case(name)
    image, text, s, w = _inputs(6, dim, 9.0, seed=dim * 10 + levels)
    loss = build_loss(name, **opts, nested=levels, nested_weight=0.7, nested_order=order).double()
    terms = loss(image, text, s, w)
    assert isinstance(loss, Nested) and "nested_loss" in terms and all(k.endswith("_loss") for k in terms)
    fast = sum(terms.values())
    bias = loss.inner.bias if name == "sigmoid" else None
    slow = ref(image, text, s, w, bias) + ref_nested_term(image, text, s, w, levels, 0.7, order)
    torch.testing.assert_close(fast, slow, rtol=1e-9, atol=1e-9)
    leaves = [image, text, s, w] + ([bias] if bias is not None else [])
    for got, want in zip(_grads(fast, leaves), _grads(slow, leaves)):
        if want is None:
            assert got is None or torch.count_nonzero(got) == 0
        else:
            assert got is not None
            torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-9)


def test_prefix_and_importance_orders_differ_and_importance_needs_w():
    image, text, s, w = _inputs(7, 8, 9.0, seed=1)
    prefix = build_loss("infonce", nested=2, nested_order="prefix")
    importance = build_loss("infonce", nested=2, nested_order="importance")
    assert not prefix.needs_importance and importance.needs_importance
    a = prefix(image, text, s)["nested_loss"]
    b = importance(image, text, s, w)["nested_loss"]
    assert abs(float(a.detach()) - float(b.detach())) > 1e-3  # w is not sorted and not uniform: other dimensions, other weights
    with pytest.raises(ValueError, match="needs the importance vector"):
        importance(image, text, s)
    ones = torch.ones(8, dtype=torch.float64)  # uniform w: the importance order is the prefix, unweighted
    torch.testing.assert_close(importance(image, text, s, ones)["nested_loss"], a, rtol=1e-12, atol=1e-12)


def test_default_order_is_importance_for_tricl_and_prefix_otherwise():
    assert build_loss("tricl", nested=1).order == "importance"
    assert build_loss("infonce", nested=1).order == "prefix"
    assert build_loss("tricl", nested=1, nested_order="prefix").order == "prefix"


def test_wrapper_uses_the_logit_scale_even_for_scale_free_objectives():
    image, text, s, w = _inputs(5, 8, 9.0, seed=2)
    plain = sum(build_loss("triplet")(image, text, s).values())
    assert torch.autograd.grad(plain, [s], allow_unused=True) == (None,)
    total = sum(build_loss("triplet", nested=1)(image, text, s).values())
    (grad,) = torch.autograd.grad(total, [s])
    assert grad.abs() > 0


@pytest.mark.parametrize("name", WRAPPABLE)
def test_nested_zero_is_the_plain_objective(name):
    opts, _ = _case(name)
    torch.manual_seed(0)
    plain = build_loss(name, **{"nested": 0, **opts}).double()  # tricl nests by default
    torch.manual_seed(0)
    zero = build_loss(name, **opts, nested=0, nested_weight=3.0, nested_order="importance").double()
    assert type(zero) is type(plain)
    image, text, s, w = _inputs(5, 8, 9.0, seed=3)
    got, want = zero(image, text, s, w), plain(image, text, s, w)
    assert got.keys() == want.keys() and "nested_loss" not in got
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0)


def test_tricl_nested_option_is_the_wrapper():
    loss = build_loss("tricl", dec_weight=0.5, nested=2)
    assert isinstance(loss, Nested) and loss.inner.config.dec_weight == 0.5
    assert set(loss(*_inputs(5, 8, 9.0, seed=4)[:3], _inputs(5, 8, 9.0, seed=4)[3])) == {
        "contrastive_loss", "decorrelation_loss", "nested_loss",
    }  # fmt: skip


@pytest.mark.parametrize(
    "opts,match",
    [
        ({"nested": -1}, "nested must be an int >= 0"),
        ({"nested": 1.5}, "nested must be an int >= 0"),
        ({"nested": True}, "nested must be an int >= 0"),
        ({"nested": "4"}, "nested must be an int >= 0"),
        ({"nested": 2, "nested_weight": -1.0}, "nested_weight must be >= 0"),
        ({"nested": 2, "nested_weight": "x"}, "nested_weight must be a number"),
        ({"nested": 2, "nested_order": "random"}, "nested_order must be one of prefix, importance"),
        ({"nested": 0, "nested_order": "pca"}, "nested_order must be one of prefix, importance"),
    ],
)
@pytest.mark.parametrize("name", ["infonce", "tricl", "sigmoid"])
def test_bad_nesting_options_are_value_errors(name, opts, match):
    with pytest.raises(LossConfigError, match=match) as info:
        build_loss(name, **opts)
    assert isinstance(info.value, ValueError) and "\n" not in str(info.value)


def test_cli_trains_an_mrl_model(tmp_path):
    """``triclip train --loss infonce --loss-opt nested=4 --loss-opt nested_order=prefix``: the options
    reach build_loss (a bad one would exit 2), w stays uniform (prefix nesting does not use it)."""
    from triclip.app.cli import main
    from triclip.data.builtin import prepare
    from triclip.model.run import load_run

    prepare("shapes", str(tmp_path / "data"), num=120, seed=1)
    args = ["train", "--train-data", str(tmp_path / "data" / "train.jsonl"), "--model", "tiny", "--loss", "infonce",
            "--epochs", "1", "--batch-size", "32", "--loss-opt", "nested=4"]  # fmt: skip
    assert main([*args, "--loss-opt", "nested_order=prefix", "--out", str(tmp_path / "run")]) == 0
    model, config = load_run(str(tmp_path / "run"), torch.device("cpu"))
    assert config["loss"] == "infonce" and config["loss_options"] == {"nested": 4, "nested_order": "prefix"}
    assert torch.equal(model.importance(), torch.ones_like(model.importance()))
    assert build_loss(config["loss"], **config["loss_options"]).order == "prefix"
    assert main([*args, "--loss-opt", "nested_order=pca", "--out", str(tmp_path / "bad")]) == 2


def test_mrl_is_infonce_with_prefix_nesting_by_default():
    image, text, s, w = _inputs(6, 16, 9.0, seed=5)
    mrl = build_loss("mrl")
    assert isinstance(mrl, Nested) and mrl.order == "prefix" and mrl.config.nested == 4 and not mrl.needs_importance
    want = build_loss("infonce", nested=4, nested_order="prefix")(image, text, s)
    got = mrl(image, text, s)
    assert got.keys() == want.keys() == {"contrastive_loss", "nested_loss"}
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0)
    slow = ref_infonce(image, text, s) + ref_nested_term(image, text, s, None, 4, 1.0, "prefix")
    torch.testing.assert_close(sum(got.values()), slow, rtol=1e-9, atol=1e-9)
    plain = build_loss("mrl", nested=0)(image, text, s)
    assert set(plain) == {"contrastive_loss"}
    assert build_loss("mrl", nested=2, nested_weight=0.5).config.nested == 2


def ref_nested_inner(name, opts, image, text, s, w, levels, weight, order):
    """weight * sum over m of the objective's own slow loop on the kept dimensions (``nested_by=inner``).

    An objective that reads w gets w of the kept dimensions and unweighted features; another gets
    the sqrt(w)-weighted compact embedding on the importance order (unweighted on the prefix).
    """
    _, ref = _case(name)
    reads_w = build_loss(name, **opts, nested=0).needs_importance
    d = image.shape[1]
    ranked = list(range(d)) if order == "prefix" else sorted(range(d), key=lambda j: (-float(w[j].detach()), j))
    weights = None if reads_w or order == "prefix" else w
    total, m = 0.0, d // 2
    for _ in range(levels):
        if m < 1:
            break
        keep = ranked[:m]
        kept_w = w[keep] if reads_w else None
        total = total + ref(ref_compact(image, weights, keep), ref_compact(text, weights, keep), s, kept_w, None)
        m //= 2
    return weight * total


@pytest.mark.parametrize("name", ["infonce", "tricl", "tricl_spectral", "triplet", "debiased"])
@pytest.mark.parametrize("order", ["prefix", "importance"])
def test_nested_by_inner_runs_the_objective_at_each_m(name, order):
    """MatryoshkaLoss's nesting: the objective's own terms on each prefix, values and grads (float64)."""
    opts, ref = _case(name)
    image, text, s, w = _inputs(6, 8, 9.0, seed=11)
    loss = build_loss(name, **opts, nested=2, nested_weight=0.7, nested_order=order, nested_by="inner").double()
    fast = sum(loss(image, text, s, w).values())
    slow = ref(image, text, s, w, None) + ref_nested_inner(name, opts, image, text, s, w, 2, 0.7, order)
    torch.testing.assert_close(fast, slow, rtol=1e-9, atol=1e-9)
    for got, want in zip(_grads(fast, [image, text, w]), _grads(slow, [image, text, w])):
        if want is None:
            assert got is None or torch.count_nonzero(got) == 0
        else:
            torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("order", ["prefix", "importance"])
def test_nested_by_inner_of_infonce_is_nesting_by_infonce(order):
    image, text, s, w = _inputs(6, 8, 9.0, seed=12)
    by_inner = build_loss("infonce", nested=3, nested_order=order, nested_by="inner")(image, text, s, w)
    by_infonce = build_loss("infonce", nested=3, nested_order=order)(image, text, s, w)
    torch.testing.assert_close(by_inner["nested_loss"], by_infonce["nested_loss"], rtol=1e-12, atol=1e-12)


def test_the_two_nestings_differ_where_the_objective_is_not_infonce():
    image, text, s, w = _inputs(6, 8, 9.0, seed=13)
    by_inner = build_loss("triplet", nested=2, nested_by="inner")
    by_infonce = build_loss("triplet", nested=2)
    assert by_infonce.config.nested_by == "infonce"  # the default: the nesting every measured run used
    inner_term = by_inner(image, text, s)["nested_loss"]
    assert abs(float(inner_term.detach()) - float(by_infonce(image, text, s)["nested_loss"].detach())) > 1e-3
    assert torch.autograd.grad(inner_term, [s], allow_unused=True) == (None,)  # the triplet loss has no scale
    with pytest.raises(LossConfigError, match="nested_by must be one of infonce, inner"):
        build_loss("triplet", nested=2, nested_by="matryoshka")
