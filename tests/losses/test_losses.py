"""The loss registry, option checks, properties between objectives and numerical safety."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from triclip.compact.features import importance_order, topm_embed
from triclip.core.errors import UserError
from triclip.losses import LossConfigError, available_losses, build_loss, loss_options
from triclip.losses.tricl import decorrelation

ALL = ["infonce", "debiased", "tricl", "align_uniform", "contrastive", "triplet", "sigmoid", "hard_negative"]
SCALE_FREE = {"align_uniform", "contrastive", "triplet", "spectral", "tricl_spectral"}  # plain: s gets no gradient


def _features(batch: int, dim: int, seed: int = 0, dtype=torch.float32, noise: float = 0.8):
    g = torch.Generator().manual_seed(seed)
    image = F.normalize(torch.randn(batch, dim, generator=g, dtype=torch.float64), dim=1)
    text = F.normalize(image + noise * torch.randn(batch, dim, generator=g, dtype=torch.float64), dim=1)
    w = 0.2 + 1.8 * torch.rand(dim, generator=g, dtype=torch.float64)
    return [x.to(dtype).requires_grad_(True) for x in (image, text, w)]


def _total(terms: dict[str, torch.Tensor]) -> torch.Tensor:
    return sum(terms.values())


# ---------------------------------------------------------------------------- registry and options


def test_registry_has_the_eight_objectives():
    spectral = ["spectral", "tricl_spectral"]  # Eq. 6 + 8: tests/losses/test_losses_spectral.py
    assert sorted(ALL + ["mrl"] + spectral) == available_losses()  # mrl: infonce with prefix nesting on by default
    nesting = {"nested": 0, "nested_weight": 1.0, "nested_order": None, "nested_by": "infonce"}  # every loss takes these
    assert loss_options("debiased") == {"tau_plus": 0.1, **nesting}
    assert loss_options("tricl") == {"dec_weight": 10.0, "tau_plus": 0.0, "renormalize": False, **nesting, "nested": 4}
    assert loss_options("triplet") == {"margin": 0.2, "mining": "semihard", **nesting}


@pytest.mark.parametrize(
    "name,opts,match",
    [
        ("nope", {}, "unknown loss 'nope'; choose from align_uniform"),
        ("debiased", {"tau": 0.1}, "has no option tau .its options: nested, nested_by, nested_order, nested_weight, tau_plus"),
        ("infonce", {"tau_plus": 0.1}, "has no option tau_plus .its options: nested, nested_by, nested_order, nested_weight"),
        ("debiased", {"tau_plus": 1.0}, r"tau_plus must be in \[0, 1\)"),
        ("debiased", {"tau_plus": -0.1}, r"tau_plus must be in \[0, 1\)"),
        ("tricl", {"tau_plus": "0.1"}, "tau_plus must be a number"),
        ("tricl", {"dec_weight": -1}, "dec_weight must be >= 0"),
        ("tricl", {"dec_weight": True}, "dec_weight must be a number"),
        ("hard_negative", {"beta": float("nan")}, "beta must be finite"),
        ("triplet", {"mining": "random"}, "mining must be one of semihard, hardest, all"),
        ("contrastive", {"margin": 0}, "margin must be > 0"),
        ("align_uniform", {"t": -2}, "t must be > 0"),
    ],
)
def test_bad_name_or_option_is_one_clear_line(name, opts, match):
    with pytest.raises(LossConfigError, match=match) as info:
        build_loss(name, **opts)
    assert isinstance(info.value, UserError) and isinstance(info.value, ValueError)
    assert "\n" not in str(info.value)


def test_options_from_the_cli_parse_to_typed_values():
    loss = build_loss("tricl", dec_weight=2, tau_plus=0, nested=0)  # ints as json gives them
    assert loss.config.dec_weight == 2.0 and isinstance(loss.config.dec_weight, float)
    assert build_loss("triplet", mining="hardest", margin=0.5).config.mining == "hardest"


@pytest.mark.parametrize(
    "args,match",
    [
        ((torch.zeros(4, 3), torch.zeros(4, 2), 1.0), "same shape"),
        ((torch.zeros(4), torch.zeros(4), 1.0), r"floating \(batch, dim\)"),
        ((torch.zeros(4, 3, dtype=torch.long), torch.zeros(4, 3), 1.0), "floating"),
        ((torch.zeros(4, 3), torch.zeros(4, 3), torch.ones(2)), "logit_scale must be a scalar"),
        ((torch.zeros(1, 3), torch.zeros(1, 3), 1.0), "at least 2 pairs"),
    ],
)
def test_bad_inputs_raise_value_error(args, match):
    with pytest.raises(ValueError, match=match):
        build_loss("infonce")(*args)


def test_tricl_needs_the_importance_vector():
    image, text, w = _features(4, 3)
    with pytest.raises(ValueError, match="needs the importance vector"):
        build_loss("tricl")(image, text, 10.0)
    with pytest.raises(ValueError, match=r"importance must have shape \(3,\)"):
        build_loss("tricl")(image, text, 10.0, torch.ones(4))


# ---------------------------------------------------------------------------- properties


@pytest.mark.parametrize("batch,dim,scale", [(2, 4, 1.0), (9, 16, 14.3), (33, 8, 100.0)])
def test_debiased_with_tau_zero_equals_infonce(batch, dim, scale):
    image, text, _ = _features(batch, dim, dtype=torch.float64)
    infonce = build_loss("infonce")(image, text, scale)["contrastive_loss"]
    debiased = build_loss("debiased", tau_plus=0.0)(image, text, scale)["contrastive_loss"]
    torch.testing.assert_close(debiased, infonce, rtol=1e-14, atol=1e-14)
    hcl = build_loss("hard_negative", beta=0.0, tau_plus=0.0)(image, text, scale)["contrastive_loss"]
    torch.testing.assert_close(hcl, infonce, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("tau", [0.05, 0.3])
def test_hard_negative_with_beta_zero_equals_debiased(tau):
    """Two independent implementations (cross-entropy form vs masked log-sum-exp form) agree."""
    image, text, _ = _features(17, 8, dtype=torch.float64)
    debiased = build_loss("debiased", tau_plus=tau)(image, text, 20.0)["contrastive_loss"]
    hcl = build_loss("hard_negative", beta=0.0, tau_plus=tau)(image, text, 20.0)["contrastive_loss"]
    torch.testing.assert_close(hcl, debiased, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("tau", [0.0, 0.2])
def test_tricl_with_unit_importance_and_no_decorrelation_is_infonce_or_debiased(tau):
    image, text, _ = _features(12, 6, dtype=torch.float64)
    ones = torch.ones(6, dtype=torch.float64)
    tri = build_loss("tricl", dec_weight=0.0, tau_plus=tau)(image, text, 30.0, ones)
    assert tri["decorrelation_loss"] == 0
    base = build_loss("debiased", tau_plus=tau) if tau else build_loss("infonce")
    want = base(image, text, 30.0)["contrastive_loss"]
    torch.testing.assert_close(tri["contrastive_loss"], want, rtol=1e-14, atol=1e-14)


def test_tricl_renormalize_is_the_cosine_of_weighted_features_and_ignores_the_scale_of_w():
    image, text, w = _features(9, 5, dtype=torch.float64)
    loss = build_loss("tricl", dec_weight=0.0, renormalize=True)
    got = loss(image, text, 20.0, w)["contrastive_loss"]
    logits = torch.empty(9, 9, dtype=torch.float64)
    for i in range(9):  # a slow loop: cosine of sqrt(w) * I_i and sqrt(w) * T_j
        for j in range(9):
            a, b = w.sqrt() * image[i], w.sqrt() * text[j]
            logits[i, j] = 20.0 * (a @ b) / (a.norm() * b.norm())
    labels = torch.arange(9)
    want = 0.5 * (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(loss(image, text, 20.0, 7.0 * w)["contrastive_loss"], got, rtol=1e-12, atol=1e-12)
    ones = torch.ones(5, dtype=torch.float64)  # unit w on unit features: the plain tri-factor logits
    plain = build_loss("tricl", dec_weight=0.0)(image, text, 20.0, ones)["contrastive_loss"]
    torch.testing.assert_close(loss(image, text, 20.0, ones)["contrastive_loss"], plain, rtol=1e-12, atol=1e-12)
    got.backward()
    assert w.grad is not None and w.grad.abs().sum() > 0


def test_tricl_nested_term_scores_what_the_compact_index_serves():
    """The nested term at m is InfoNCE on compact.topm_embed in the importance order."""
    image, text, w = _features(9, 8, dtype=torch.float64)
    got = build_loss("tricl", dec_weight=0.0, nested=2)(image, text, 20.0, w)["nested_loss"]
    order = importance_order(w.detach())
    labels = torch.arange(9)
    terms = []
    for m in (4, 2):
        logits = 20.0 * topm_embed(image, w, order, m) @ topm_embed(text, w, order, m).t()
        terms.append(0.5 * (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)))
    torch.testing.assert_close(got, sum(terms), rtol=1e-12, atol=1e-12)
    got.backward()
    assert w.grad is not None and w.grad.abs().sum() > 0
    assert "nested_loss" not in build_loss("tricl", nested=0)(image, text, 20.0, w)
    assert "nested_loss" in build_loss("tricl")(image, text, 20.0, w)  # tricl nests by default (its own default)


@pytest.mark.parametrize("opts", [{"nested": -1}, {"nested": 1.5}, {"nested": True}, {"nested_weight": -1.0}])
def test_tricl_rejects_bad_nested_options(opts):
    with pytest.raises(ValueError, match="nested"):
        build_loss("tricl", **opts)


@pytest.mark.parametrize("name", ALL)
def test_symmetric_under_swapping_the_towers(name):
    image, text, w = _features(10, 6, dtype=torch.float64)
    loss = build_loss(name)
    forward = {k: v.detach() for k, v in loss(image, text, 12.0, w).items()}
    swapped = {k: v.detach() for k, v in loss(text, image, 12.0, w).items()}
    assert forward.keys() == swapped.keys()
    for key in forward:
        torch.testing.assert_close(forward[key], swapped[key], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ALL)
def test_gradients_reach_features_scale_and_importance(name):
    image, text, w = _features(8, 5)
    s = torch.tensor(14.3, requires_grad=True)
    loss = build_loss(name)
    if name in ("contrastive",):
        loss = build_loss(name, margin=1.9)  # random unit pairs sit ~sqrt(2) apart: make push active
    _total(loss(image, text, s, w)).backward()
    for x in (image, text):
        assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    if name not in SCALE_FREE:
        assert s.grad is not None and torch.isfinite(s.grad) and s.grad != 0
    else:
        assert s.grad is None
    if loss.needs_importance:
        assert w.grad is not None and torch.isfinite(w.grad).all() and w.grad.abs().sum() > 0
    else:
        assert w.grad is None
    if name == "sigmoid":
        assert loss.bias.grad is not None and loss.bias.grad != 0
        assert [n for n, _ in loss.named_parameters()] == ["bias"]


def test_decorrelation_gram_shortcut_matches_direct_formula():
    """B < D uses ||Z Z^T||_F; it must equal mean(((D/B) Z^T Z - Id)^2) in value and gradient."""
    for batch, dim in [(3, 10), (10, 3), (7, 7), (2, 64)]:
        z = torch.randn(batch, dim, dtype=torch.float64, requires_grad=True)
        direct = ((dim / batch) * z.t() @ z - torch.eye(dim, dtype=torch.float64)).square().mean()
        fast = decorrelation(z)
        torch.testing.assert_close(fast, direct, rtol=1e-12, atol=1e-12)
        (g_fast,) = torch.autograd.grad(fast, z)
        (g_direct,) = torch.autograd.grad(direct, z)
        torch.testing.assert_close(g_fast, g_direct, rtol=1e-10, atol=1e-12)


def test_decorrelation_is_zero_for_an_isotropic_batch_and_large_when_collapsed():
    basis = torch.eye(8, dtype=torch.float64)  # D * E[z z^T] = Id exactly
    assert float(decorrelation(basis)) == pytest.approx(0.0, abs=1e-15)
    collapsed = F.normalize(torch.ones(16, 8, dtype=torch.float64), dim=1)
    assert float(decorrelation(collapsed)) == pytest.approx(1 - 1 / 8)


# ---------------------------------------------------------------------------- numerical safety


def _finite_everywhere(name, image, text, s, w, **opts):
    loss = build_loss(name, **opts)
    terms = loss(image, text, s, w)
    for key, value in terms.items():
        assert key.endswith("_loss") and value.ndim == 0 and torch.isfinite(value), (name, key, value)
    _total(terms).backward()
    for x in (image, text, s, w):
        assert x.grad is None or torch.isfinite(x.grad).all(), name


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("noise", [0.0, 0.8, 20.0])
def test_finite_values_and_gradients_at_logit_scale_100_fp32(name, noise):
    """Aligned (noise 0: pos=exp(100) overflows a naive fp32 sum), typical, and random pairs."""
    image, text, w = _features(64, 32, seed=1, noise=noise)
    s = torch.tensor(100.0, requires_grad=True)
    _finite_everywhere(name, image, text, s, w)


@pytest.mark.parametrize(
    "name,opts",
    [("debiased", {"tau_plus": 0.99}), ("tricl", {"tau_plus": 0.5}), ("hard_negative", {"beta": 5.0, "tau_plus": 0.5})],
)
def test_floor_branch_has_finite_gradients_where_the_estimate_is_negative(name, opts):
    """Identical pairs and a huge tau_plus: sum_neg - tau*N*pos < 0 on every row, so log(...) of the
    unclamped branch would be NaN; the floor is taken and the gradients stay finite."""
    image, _, w = _features(16, 8, seed=2)
    text = image.detach().clone().requires_grad_(True)
    s = torch.tensor(100.0, requires_grad=True)
    _finite_everywhere(name, image, text, s, w, **opts)


@pytest.mark.parametrize("name", ALL)
def test_bf16_autocast_gives_finite_fp32_losses(name):
    """Under bf16 autocast the features arrive in bf16; the loss computes in fp32, no NaN."""
    g = torch.Generator().manual_seed(0)
    proj = torch.nn.Linear(12, 16)
    x = torch.randn(32, 12, generator=g)
    w = torch.rand(16, requires_grad=True)
    s = torch.tensor(100.0, requires_grad=True)
    loss = build_loss(name)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        feats = F.normalize(proj(x), dim=1)
        assert feats.dtype == torch.bfloat16
        terms = loss(feats, feats.flip(0).roll(1, 0), s, w)
    assert all(v.dtype == torch.float32 and torch.isfinite(v) for v in terms.values())
    _total(terms).backward()
    assert torch.isfinite(proj.weight.grad).all() and proj.weight.grad.abs().sum() > 0
    reference = loss(feats.detach().float(), feats.detach().float().flip(0).roll(1, 0), s.detach(), w.detach())
    for key in terms:
        torch.testing.assert_close(terms[key].detach(), reference[key], rtol=1e-5, atol=1e-5)


def test_float64_inputs_stay_float64():
    image, text, w = _features(4, 3, dtype=torch.float64)
    assert all(v.dtype == torch.float64 for v in build_loss("tricl")(image, text, 5.0, w).values())


@pytest.mark.parametrize("tau", [0.0, 0.2, 0.6])
def test_infonce_head_backward_passes_gradcheck(tau):
    """The hand-written backward of the (debiased) InfoNCE head, floor rows included."""
    from triclip.losses.infonce import debiased_infonce, symmetric_infonce

    g = torch.Generator().manual_seed(4)
    image = F.normalize(torch.randn(6, 4, generator=g, dtype=torch.float64), dim=1)
    logits = (3.0 * image @ F.normalize(image + 0.7 * torch.randn(6, 4, generator=g, dtype=torch.float64), dim=1).t())
    logits.requires_grad_(True)
    scale = torch.tensor(3.0, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda L, s: debiased_infonce(L, s, tau), (logits, scale))
    assert torch.autograd.gradcheck(symmetric_infonce, (logits,))


def test_decorrelation_backward_passes_gradcheck():
    for shape in [(3, 6), (6, 3)]:  # both Gram forms
        z = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(decorrelation, (z,))


# ---------------------------------------------------------------------------- benchmark command


def test_benchmark_command_prints_a_table_with_every_objective(capsys):
    """The benchmark runs (tiny sizes) and prints one row per objective with infonce's ratio 1.00."""
    from benchmarks.bench_losses import main

    assert main(["--batch", "8", "16", "--dim", "4", "--repeats", "1", "--warmup", "0", "--no-open-clip"]) == 0
    out = capsys.readouterr().out
    assert "| objective | B=8 ms | x infonce | x infonce (min) | B=16 ms | x infonce | x infonce (min) |" in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "objective" not in line]
    assert {row.split(" | ")[0][2:].split(" (")[0] for row in rows} == set(ALL) | {"F.cross_entropy x2"}
    cells = [c.strip() for c in rows[0].strip("|").split("|")]  # name, then (ms, x, x min) per batch size
    assert cells[0] == "infonce" and [cells[i] for i in (2, 3, 5, 6)] == ["1.00"] * 4


def test_python_float_logit_scale_keeps_float64_precision():
    """A Python number is not rounded to float32 on its way in (1/0.07 is not a float32 value)."""
    image, text, _ = _features(6, 4, dtype=torch.float64)
    as_float = build_loss("debiased")(image, text, 1 / 0.07)["contrastive_loss"]
    as_tensor = build_loss("debiased")(image, text, torch.tensor(1 / 0.07, dtype=torch.float64))["contrastive_loss"]
    assert as_float.item() == as_tensor.item()
