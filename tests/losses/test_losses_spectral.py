"""``spectral`` and ``tricl_spectral`` against slow loops written from Eq. 6 / Eq. 8, plus their limits.

The loops take ``u = sqrt(D) * z`` one pair (i, j) at a time and ``E[u u^T]`` one entry (k, l)
at a time. Nesting and the other generic checks (scale 100, bf16, the nested loop) run through
``CASES`` of ``test_losses_reference.py``, which lists these losses too.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from triclip.losses import Nested, build_loss
from triclip.losses.nested import nested_infonce
from triclip.model.model import IMPORTANCE_FORMS, initial_theta

# ---------------------------------------------------------------------------- reference loops


def ref_l_tri(image, text, w=None):
    """Eq. 6 on pairs: -2 mean_i u_i^T S v_i + mean_{i != j} (u_i^T S v_j)^2, u = sqrt(D) I, v = sqrt(D) T."""
    b, d = image.shape
    u, v = math.sqrt(d) * image, math.sqrt(d) * text
    s = torch.ones(d, dtype=image.dtype) if w is None else w

    def score(i, j):
        return sum(u[i, k] * s[k] * v[j, k] for k in range(d))

    positive = sum(score(i, i) for i in range(b)) / b
    negative = sum(score(i, j) ** 2 for i in range(b) for j in range(b) if j != i) / (b * (b - 1))
    return -2.0 * positive + negative


def ref_l_dec(z):
    """Eq. 8: sum over entries (k, l) of (E_x[u_k u_l] - [k == l])^2, u = sqrt(D) z, E over the batch."""
    b, d = z.shape
    u = math.sqrt(d) * z
    total = 0.0
    for k in range(d):
        for l in range(d):
            second_moment = sum(u[n, k] * u[n, l] for n in range(b)) / b
            total = total + (second_moment - (1.0 if k == l else 0.0)) ** 2
    return total


def ref_spectral(image, text):
    return ref_l_tri(image, text)


def ref_tricl_spectral(image, text, w, dec_weight):
    return ref_l_tri(image, text, w) + dec_weight * 0.5 * (ref_l_dec(image) + ref_l_dec(text))


# ---------------------------------------------------------------------------- helpers


def _inputs(batch, dim, seed, dtype=torch.float64, noise=0.8):
    g = torch.Generator().manual_seed(seed)
    image = F.normalize(torch.randn(batch, dim, generator=g, dtype=torch.float64), dim=1)
    text = F.normalize(image + noise * torch.randn(batch, dim, generator=g, dtype=torch.float64), dim=1)
    w = 0.2 + 1.8 * torch.rand(dim, generator=g, dtype=torch.float64)
    return [x.to(dtype).detach().requires_grad_(True) for x in (image, text, w)]


def _whitened(batch_blocks: int, dim: int, seed: int) -> torch.Tensor:
    """Rows of ``batch_blocks`` random orthogonal matrices: unit rows, (1/B) U^T U = Id exactly (U = sqrt(D) Z)."""
    g = torch.Generator().manual_seed(seed)
    blocks = [torch.linalg.qr(torch.randn(dim, dim, generator=g, dtype=torch.float64))[0] for _ in range(batch_blocks)]
    return torch.cat(blocks)  # (blocks * D, D)


def _total(terms):
    return sum(terms.values())


# ---------------------------------------------------------------------------- values and gradients


@pytest.mark.parametrize("batch,dim", [(2, 3), (5, 8), (12, 4), (7, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name,opts", [("spectral", {}), ("tricl_spectral", {}), ("tricl_spectral", {"dec_weight": 0.3})])
def test_value_and_gradients_match_the_loop(name, opts, batch, dim, dtype):
    image, text, w = _inputs(batch, dim, seed=batch * 100 + dim, dtype=dtype)
    terms = build_loss(name, **opts)(image, text, 14.3, w)
    assert all(k.endswith("_loss") and v.dtype == dtype for k, v in terms.items())
    fast = _total(terms)
    as64 = [x.detach().double().requires_grad_(True) for x in (image, text, w)]
    if name == "spectral":
        slow = ref_spectral(as64[0], as64[1])
    else:
        slow = ref_tricl_spectral(*as64, opts.get("dec_weight", 1.0))
    tol = {"rtol": 1e-9, "atol": 1e-9} if dtype == torch.float64 else {"rtol": 2e-5, "atol": 2e-4}
    torch.testing.assert_close(fast.double(), slow, **tol)
    leaves = [image, text] + ([w] if name == "tricl_spectral" else [])
    got = torch.autograd.grad(fast, leaves)
    want = torch.autograd.grad(slow, as64[: len(leaves)])
    for g_fast, g_slow in zip(got, want):
        torch.testing.assert_close(g_fast.double(), g_slow, **tol)


def test_options_and_flags():
    assert not build_loss("spectral").needs_importance
    loss = build_loss("tricl_spectral")
    assert loss.needs_importance and loss.config.dec_weight == 1.0
    with pytest.raises(ValueError, match="dec_weight must be >= 0"):
        build_loss("tricl_spectral", dec_weight=-1.0)
    with pytest.raises(ValueError, match="has no option dec_weight"):
        build_loss("spectral", dec_weight=1.0)
    with pytest.raises(ValueError, match="needs the importance vector"):
        build_loss("tricl_spectral")(*_inputs(4, 3, seed=0)[:2], 1.0)


# ---------------------------------------------------------------------------- limits and properties


@pytest.mark.parametrize("batch,dim", [(6, 8), (20, 4)])
def test_with_s_identity_tricl_spectral_without_its_l_dec_is_spectral(batch, dim):
    """theta at softplus^-1(1) with the paper's softplus form (the flat start) gives S = Id."""
    image, text, _ = _inputs(batch, dim, seed=3)
    theta = torch.full((dim,), math.log(math.e - 1.0), dtype=torch.float64)  # softplus^-1(1)
    torch.testing.assert_close(initial_theta(dim), theta.float(), rtol=0, atol=0)  # the model's flat start
    w = IMPORTANCE_FORMS["softplus"](theta)
    torch.testing.assert_close(w, torch.ones(dim, dtype=torch.float64), rtol=0, atol=1e-15)
    tri = build_loss("tricl_spectral", dec_weight=2.0)(image, text, 1.0, w)
    plain = build_loss("spectral")(image, text, 1.0)
    torch.testing.assert_close(_total(tri) - tri["decorrelation_loss"], plain["spectral_loss"], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(tri["decorrelation_loss"], 2.0 * 0.5 * (ref_l_dec(image) + ref_l_dec(text)))
    assert tri["decorrelation_loss"] > 0.1  # a random batch is not white


@pytest.mark.parametrize("blocks,dim", [(1, 8), (2, 8), (3, 5)])
def test_l_dec_is_zero_for_whitened_features(blocks, dim):
    image, text = _whitened(blocks, dim, seed=dim), _whitened(blocks, dim, seed=dim + 1)
    torch.testing.assert_close(image.norm(dim=1), torch.ones(blocks * dim, dtype=torch.float64))
    u = math.sqrt(dim) * image
    torch.testing.assert_close(u.t() @ u / len(u), torch.eye(dim, dtype=torch.float64))
    terms = build_loss("tricl_spectral", dec_weight=5.0)(image, text, 1.0, torch.ones(dim, dtype=torch.float64))
    assert float(terms["decorrelation_loss"]) == pytest.approx(0.0, abs=1e-10)
    collapsed = F.normalize(torch.ones(blocks * dim, dim, dtype=torch.float64), dim=1)  # E[uu^T] = all ones
    terms = build_loss("tricl_spectral", dec_weight=1.0)(collapsed, collapsed, 1.0, torch.ones(dim, dtype=torch.float64))
    assert float(terms["decorrelation_loss"]) == pytest.approx(dim * dim - dim)  # ||ones - Id||^2


@pytest.mark.parametrize("name", ["spectral", "tricl_spectral"])
def test_symmetric_under_swapping_the_towers(name):
    image, text, w = _inputs(10, 6, seed=4)
    loss = build_loss(name)
    forward = {k: v.detach() for k, v in loss(image, text, 12.0, w).items()}
    swapped = {k: v.detach() for k, v in loss(text, image, 12.0, w).items()}
    assert forward.keys() == swapped.keys()
    for key in forward:
        torch.testing.assert_close(forward[key], swapped[key], rtol=1e-12, atol=1e-12)


def test_aligned_uniform_pairs_score_minus_d():
    """Perfect pairs on a whitened batch: positives score D, no L_dec, and the negatives' mean square
    is (B D - D^2) / (B - 1), from sum_ij (u_i^T u_j)^2 = ||U^T U||_F^2 = B^2 D."""
    z = _whitened(2, 4, seed=9)
    terms = build_loss("tricl_spectral")(z, z, 1.0, torch.ones(4, dtype=torch.float64))
    b = len(z)
    torch.testing.assert_close(terms["spectral_loss"], torch.tensor(-2.0 * 4 + (b * 4 - 16) / (b - 1), dtype=torch.float64))
    assert float(terms["decorrelation_loss"]) == pytest.approx(0.0, abs=1e-12)


def test_gradcheck_features_and_theta_float64():
    """Gradients reach both towers' features and theta (through w = softplus(theta)), checked numerically."""
    image, text, _ = _inputs(4, 3, seed=5)
    theta = torch.randn(3, dtype=torch.float64, requires_grad=True)
    loss = build_loss("tricl_spectral", dec_weight=0.7)

    def objective(i, t, th):
        return _total(loss(i, t, 1.0, IMPORTANCE_FORMS["softplus"](th)))

    assert torch.autograd.gradcheck(objective, (image, text, theta))
    grads = torch.autograd.grad(objective(image, text, theta), (image, text, theta))
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)
    assert torch.autograd.gradcheck(lambda i, t: _total(build_loss("spectral")(i, t, 1.0)), (image, text))


def test_free_scale_of_s_has_one_optimum():
    """The squared negative term fixes the scale of S: L_tri(cS) = -2cP + c^2 N is least at c = P / N."""
    image, text, w = (x.detach() for x in _inputs(8, 6, seed=6, noise=0.3))
    loss = build_loss("tricl_spectral", dec_weight=0.0)
    values = {c: float(loss(image, text, 1.0, c * w)["spectral_loss"]) for c in (0.5, 1.0, 2.0)}
    # From L(1) = -2P + N and L(2) = -4P + 4N: N = (L(2) - 2 L(1)) / 2, P = (N - L(1)) / 2.
    n = (values[2.0] - 2 * values[1.0]) / 2
    pos = (n - values[1.0]) / 2
    assert n > 0 and pos > 0
    best = pos / n
    at_best = float(loss(image, text, 1.0, best * w)["spectral_loss"])
    assert at_best == pytest.approx(-pos * pos / n, rel=1e-9)
    assert all(at_best < v for v in values.values())


# ---------------------------------------------------------------------------- nesting


def test_nesting_composes_on_the_importance_order():
    image, text, w = _inputs(6, 8, seed=7)
    s = torch.tensor(9.0, dtype=torch.float64, requires_grad=True)
    nested = build_loss("tricl_spectral", dec_weight=0.5, nested=2)
    assert isinstance(nested, Nested) and nested.order == "importance" and nested.needs_importance
    got = nested(image, text, s, w)
    plain = build_loss("tricl_spectral", dec_weight=0.5)(image, text, s, w)
    assert got.keys() == {*plain, "nested_loss"}
    for key in plain:
        torch.testing.assert_close(got[key], plain[key], rtol=0, atol=0)
    torch.testing.assert_close(got["nested_loss"], nested_infonce(image, text, s, w, 2))
    (g_s,) = torch.autograd.grad(_total(got), [s])
    assert g_s != 0
    assert build_loss("spectral", nested=1).order == "prefix"
    prefix = build_loss("spectral", nested=1)(image, text, s)
    torch.testing.assert_close(prefix["nested_loss"], nested_infonce(image, text, s, None, 1))


# ---------------------------------------------------------------------------- the trainer


def test_cli_trains_both_on_shapes(tmp_path):
    """``triclip train --loss tricl_spectral`` starts S flat with the softplus form and learns a non-flat S;
    ``--loss spectral`` leaves w untouched (it does not use it)."""
    import json

    from triclip.app.cli import main
    from triclip.compact.features import importance_order
    from triclip.data.builtin import prepare
    from triclip.model.run import load_run

    prepare("shapes", str(tmp_path / "data"), num=120, seed=1)
    data = tmp_path / "data"
    args = ["train", "--train-data", str(data / "train.jsonl"), "--val-data", str(data / "val.jsonl"),
            "--model", "tiny", "--epochs", "2", "--batch-size", "32", "--max-steps", "6"]  # fmt: skip
    assert main([*args, "--loss", "tricl_spectral", "--out", str(tmp_path / "tri")]) == 0
    model, config = load_run(str(tmp_path / "tri"), torch.device("cpu"), which="last")
    assert config["model"]["importance"] == "softplus" and config["model"]["importance_spread"] == 1.0
    assert config["loss_options"] == {} and config["train"]["importance"] == "softplus"
    w = model.importance().detach()
    assert float(w.max() - w.min()) > 1e-4  # moved from the flat start S = Id
    assert not torch.allclose(w.mean(), torch.tensor(1.0), atol=1e-6)  # the free scale of S trained too
    record = [json.loads(line) for line in (tmp_path / "tri" / "metrics.jsonl").read_text().splitlines()][-1]
    assert record["importance"]["sorted"] == sorted(record["importance"]["sorted"], reverse=True)
    assert record["importance"]["sorted"][0] > record["importance"]["sorted"][-1]
    assert torch.equal(importance_order(w), torch.argsort(w, descending=True, stable=True))  # the compact order

    assert main([*args, "--loss", "spectral", "--out", str(tmp_path / "spec")]) == 0
    model, config = load_run(str(tmp_path / "spec"), torch.device("cpu"), which="last")
    assert config["model"]["importance"] == "softplus_mean1"
    assert torch.equal(model.importance(), torch.ones_like(model.importance()))

    given = [*args, "--loss", "tricl_spectral", "--importance", "softplus_mean1", "--importance-spread", "10"]
    assert main([*given, "--out", str(tmp_path / "mean1")]) == 0  # typed options win over the objective's
    _, config = load_run(str(tmp_path / "mean1"), torch.device("cpu"), which="last")
    assert config["model"]["importance"] == "softplus_mean1" and config["model"]["importance_spread"] == 10.0
