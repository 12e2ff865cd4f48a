"""Every objective against a slow loop written straight from its paper's equation.

The loops work on Python scalars-as-tensors in float64, with plain ``exp``/``log``
(no log-space tricks), one pair at a time: an independent check of the fast, fused,
log-space implementations in ``triclip.losses``, in values and in gradients.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from triclip.losses import build_loss
from tests.losses.test_losses_spectral import ref_spectral, ref_tricl_spectral

# ---------------------------------------------------------------------------- reference loops


def _dot(a, b, w=None):
    return (a * b).sum() if w is None else (a * w * b).sum()


def _directions(image, text):
    """(anchors, candidates) for image->text and text->image."""
    return ((image, text), (text, image))


def ref_infonce(image, text, s, w=None):
    """CLIP: -log(exp(s<a_i, c_i>) / sum_j exp(s<a_i, c_j>)), mean over rows and directions."""
    b = len(image)
    total = 0.0
    for anchors, cands in _directions(image, text):
        for i in range(b):
            num = torch.exp(s * _dot(anchors[i], cands[i], w))
            den = sum(torch.exp(s * _dot(anchors[i], cands[j], w)) for j in range(b))
            total = total - torch.log(num / den)
    return total / (2 * b)


def ref_debiased(image, text, s, tau_plus, w=None, beta=None):
    """Chuang et al. 2020 (eq. 6 + clamp); with ``beta`` the HCL reweighting (Robinson et al. 2021)."""
    b = len(image)
    n = b - 1
    total = 0.0
    for anchors, cands in _directions(image, text):
        for i in range(b):
            pos = torch.exp(s * _dot(anchors[i], cands[i], w))
            negs = [torch.exp(s * _dot(anchors[i], cands[j], w)) for j in range(b) if j != i]
            if beta is None:
                neg_sum = sum(negs)
            else:
                imp = [neg**beta for neg in negs]
                neg_sum = sum(m * neg for m, neg in zip(imp, negs)) / (sum(imp) / n)
            ng = torch.maximum((neg_sum - tau_plus * n * pos) / (1 - tau_plus), n * torch.exp(-s))
            total = total - torch.log(pos / (pos + ng))
    return total / (2 * b)


def ref_decorrelation(z):
    """mean(((D/B) Z^T Z - Id)^2), Z^T Z built as a sum of outer products."""
    b, d = z.shape
    corr = sum(torch.outer(z[k], z[k]) for k in range(b)) * (d / b)
    return ((corr - torch.eye(d, dtype=z.dtype)) ** 2).mean()


def ref_tricl(image, text, s, w, dec_weight, tau_plus):
    if tau_plus > 0:
        contrastive = ref_debiased(image, text, s, tau_plus, w=w)
    else:
        contrastive = ref_infonce(image, text, s, w=w)
    return contrastive + dec_weight * 0.5 * (ref_decorrelation(image) + ref_decorrelation(text))


def ref_top_m(z, w, keep):
    """Rows of ``sqrt(w) * z`` restricted to ``keep``, each divided by its norm."""
    rows = []
    for k in range(len(z)):
        v = torch.stack([z[k, d] * torch.sqrt(w[d]) for d in keep])
        rows.append(v / torch.sqrt(sum(x * x for x in v)))
    return torch.stack(rows)


def ref_nested(image, text, s, w, levels, weight):
    """Sum over m = D/2 ... D/2**levels (m >= 1) of InfoNCE on the top-m embedding (largest w first)."""
    d = image.shape[1]
    ranked = sorted(range(d), key=lambda j: (-float(w[j].detach()), j))
    terms = []
    for k in range(1, levels + 1):
        if d >> k >= 1:
            keep = ranked[: d >> k]
            terms.append(ref_infonce(ref_top_m(image, w, keep), ref_top_m(text, w, keep), s))
    return weight * sum(terms)


def ref_align_uniform(image, text, alpha, t, align_weight=1.0, unif_weight=1.0):
    """Wang & Isola 2020: E||x - y||^alpha and log E exp(-t||x - x'||^2) over distinct pairs."""
    b = len(image)
    align = sum(torch.linalg.norm(image[i] - text[i]) ** alpha for i in range(b)) / b
    unif = 0.0
    for z in (image, text):
        pairs = [torch.exp(-t * torch.linalg.norm(z[i] - z[j]) ** 2) for i in range(b) for j in range(b) if i != j]
        unif = unif + 0.5 * torch.log(sum(pairs) / len(pairs))
    return align_weight * align + unif_weight * unif


def ref_contrastive(image, text, margin):
    """DrLIM: 0.5 d^2 on positives, 0.5 max(0, m - d)^2 on negatives, each averaged."""
    b = len(image)
    pull = sum(0.5 * torch.linalg.norm(image[i] - text[i]) ** 2 for i in range(b)) / b
    push = [
        0.5 * torch.clamp(margin - torch.linalg.norm(image[i] - text[j]), min=0) ** 2
        for i in range(b)
        for j in range(b)
        if i != j
    ]
    return pull + sum(push) / len(push)


def ref_triplet(image, text, margin, mining):
    """FaceNet with squared distances; semihard as TensorFlow Addons picks it."""
    b = len(image)
    total = 0.0
    for anchors, cands in _directions(image, text):
        per_dir = []
        for i in range(b):
            d_ap = ((anchors[i] - cands[i]) ** 2).sum()
            d_an = [((anchors[i] - cands[j]) ** 2).sum() for j in range(b) if j != i]
            if mining == "all":
                per_dir += [torch.clamp(d_ap - d + margin, min=0) for d in d_an]
                continue
            if mining == "hardest":
                chosen = min(d_an, key=lambda d: d.item())
            else:
                farther = [d for d in d_an if d.item() > d_ap.item()]
                chosen = min(farther, key=lambda d: d.item()) if farther else max(d_an, key=lambda d: d.item())
            per_dir.append(torch.clamp(d_ap - chosen + margin, min=0))
        total = total + 0.5 * sum(per_dir) / len(per_dir)
    return total


def ref_sigmoid(image, text, s, bias):
    """SigLIP: -(1/B) sum_ij log(1 / (1 + exp(-z_ij (s<x_i, y_j> + b))))."""
    b = len(image)
    total = 0.0
    for i in range(b):
        for j in range(b):
            z = 1.0 if i == j else -1.0
            total = total - torch.log(1.0 / (1.0 + torch.exp(-z * (s * _dot(image[i], text[j]) + bias))))
    return total / b


# (loss name, options, reference(image, text, s, w, bias) -> scalar)
CASES = [
    ("infonce", {}, lambda i, t, s, w, b: ref_infonce(i, t, s)),
    ("debiased", {"tau_plus": 0.05}, lambda i, t, s, w, b: ref_debiased(i, t, s, 0.05)),
    ("debiased", {"tau_plus": 0.3}, lambda i, t, s, w, b: ref_debiased(i, t, s, 0.3)),
    # tricl nests by default (nested=4, its own default): nested=0 is the objective alone, the cases after add nesting
    ("tricl", {"dec_weight": 1.0, "nested": 0}, lambda i, t, s, w, b: ref_tricl(i, t, s, w, 1.0, 0.0)),
    ("tricl", {"dec_weight": 0.0, "nested": 0}, lambda i, t, s, w, b: ref_tricl(i, t, s, w, 0.0, 0.0)),
    ("tricl", {"dec_weight": 0.5, "tau_plus": 0.2, "nested": 0}, lambda i, t, s, w, b: ref_tricl(i, t, s, w, 0.5, 0.2)),
    (
        "tricl",
        {"dec_weight": 0.5, "nested": 1, "nested_weight": 0.7},
        lambda i, t, s, w, b: ref_tricl(i, t, s, w, 0.5, 0.0) + ref_nested(i, t, s, w, 1, 0.7),
    ),
    ("hard_negative", {"beta": 1.0, "tau_plus": 0.1}, lambda i, t, s, w, b: ref_debiased(i, t, s, 0.1, beta=1.0)),
    ("hard_negative", {"beta": 0.5, "tau_plus": 0.0}, lambda i, t, s, w, b: ref_debiased(i, t, s, 0.0, beta=0.5)),
    ("align_uniform", {}, lambda i, t, s, w, b: ref_align_uniform(i, t, 2.0, 2.0)),
    (
        "align_uniform",
        {"alpha": 1.0, "t": 3.0, "unif_weight": 0.5},
        lambda i, t, s, w, b: ref_align_uniform(i, t, 1.0, 3.0, 1.0, 0.5),
    ),
    ("contrastive", {"margin": 1.2}, lambda i, t, s, w, b: ref_contrastive(i, t, 1.2)),
    ("triplet", {"margin": 0.2, "mining": "semihard"}, lambda i, t, s, w, b: ref_triplet(i, t, 0.2, "semihard")),
    ("triplet", {"margin": 0.5, "mining": "hardest"}, lambda i, t, s, w, b: ref_triplet(i, t, 0.5, "hardest")),
    ("triplet", {"margin": 0.3, "mining": "all"}, lambda i, t, s, w, b: ref_triplet(i, t, 0.3, "all")),
    ("sigmoid", {"bias_init": -3.0}, lambda i, t, s, w, b: ref_sigmoid(i, t, s, b)),
    ("spectral", {}, lambda i, t, s, w, b: ref_spectral(i, t)),
    ("tricl_spectral", {"dec_weight": 0.5}, lambda i, t, s, w, b: ref_tricl_spectral(i, t, w, 0.5)),
]
CASE_IDS = [f"{name}-{'-'.join(f'{k}={v}' for k, v in opts.items()) or 'default'}" for name, opts, _ in CASES]


def _inputs(batch: int, dim: int, scale: float, seed: int, dtype=torch.float64):
    """Unit features (partly correlated pairs), a scale tensor and a positive importance vector."""
    g = torch.Generator().manual_seed(seed)
    image = F.normalize(torch.randn(batch, dim, generator=g, dtype=torch.float64), dim=1)
    text = F.normalize(image + 0.8 * torch.randn(batch, dim, generator=g, dtype=torch.float64), dim=1)
    w = 0.2 + 1.8 * torch.rand(dim, generator=g, dtype=torch.float64)
    scale_t = torch.tensor(scale, dtype=torch.float64)
    return [x.to(dtype).detach().requires_grad_(True) for x in (image, text, scale_t, w)]


def _fast(name, opts, image, text, s, w):
    loss = build_loss(name, **opts).to(torch.float64)
    terms = loss(image, text, s, w)
    assert all(k.endswith("_loss") for k in terms)
    return sum(terms.values()), loss


def _grads(value, tensors):
    return torch.autograd.grad(value, tensors, allow_unused=True)


# ---------------------------------------------------------------------------- values and gradients


@pytest.mark.parametrize("case", range(len(CASES)), ids=CASE_IDS)
@pytest.mark.parametrize("batch,dim", [(2, 3), (5, 8), (12, 4)])
@pytest.mark.parametrize("scale", [1.0, 14.3, 100.0])
def test_value_and_gradients_match_reference_loop(case, batch, dim, scale):
    name, opts, ref = CASES[case]
    image, text, s, w = _inputs(batch, dim, scale, seed=batch * 100 + dim)
    fast, loss = _fast(name, opts, image, text, s, w)
    bias = loss.bias if name == "sigmoid" else None
    slow = ref(image, text, s, w, bias)
    assert torch.isfinite(fast)
    torch.testing.assert_close(fast, slow, rtol=1e-9, atol=1e-9)
    leaves = [image, text, s, w] + ([bias] if bias is not None else [])
    for got, want in zip(_grads(fast, leaves), _grads(slow, leaves)):
        if want is None:
            assert got is None or torch.count_nonzero(got) == 0
        else:
            assert got is not None
            torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-9)


def _floor_flags(image, text, s, w, tau):
    """Per row: (floor binds, pos + unclamped Ng <= 0), from the plain formula, both directions."""
    logits = s * (image * w) @ text.t()
    flags = []
    for m in (logits, logits.t()):
        pos = m.diagonal().exp()
        ng = (m.exp().sum(1) - pos - tau * (len(m) - 1) * pos) / (1 - tau)
        flags += list(zip((ng < (len(m) - 1) * torch.exp(-s)).tolist(), (pos + ng <= 0).tolist()))
    return flags


@pytest.mark.parametrize(
    "name,opts,tau", [("debiased", {"tau_plus": 0.5}, 0.5), ("tricl", {"tau_plus": 0.3, "dec_weight": 0.0, "nested": 0}, 0.3)]
)
def test_clamp_branch_matches_reference(name, opts, tau):
    """Some pairs aligned, some not: rows where the N*exp(-s) floor binds (with Ng <= -pos or not)
    and rows where it does not, in one batch; values and gradients still match the loop."""
    image, text, s, w = _inputs(6, 5, 5.0, seed=3)
    with torch.no_grad():
        noise = torch.tensor([0, 0, 0, 50, 50, 50.0], dtype=torch.float64)[:, None]  # rows 3-5: unrelated text
        text.copy_(F.normalize(image + noise * text, dim=1))
    wi = w if name == "tricl" else None
    flags = _floor_flags(image.detach(), text.detach(), s.detach(), w.detach() if wi is not None else 1.0, tau)
    assert {f for f in flags} >= {(True, True), (False, False)}
    fast, _ = _fast(name, opts, image, text, s, w)
    slow = ref_debiased(image, text, s, tau, w=wi)
    torch.testing.assert_close(fast, slow, rtol=1e-10, atol=1e-10)
    leaves = [image, text, s] + ([w] if wi is not None else [])
    for got, want in zip(_grads(fast, leaves), _grads(slow, leaves)):
        torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-10)


@pytest.mark.parametrize("case", range(len(CASES)), ids=CASE_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_inputs_match_reference(case, dtype):
    """fp32 and bf16 inputs (computed in fp32) agree with the float64 loop on the same rounded values."""
    name, opts, ref = CASES[case]
    image, text, s, w = _inputs(8, 16, 50.0, seed=11, dtype=dtype)
    loss = build_loss(name, **opts)
    terms = loss(image, text, s, w)
    fast = sum(terms.values())
    assert fast.dtype == torch.float32
    as64 = [x.detach().double() for x in (image, text, s, w)]
    bias = loss.bias.detach().double() if name == "sigmoid" else None
    slow = ref(*as64, bias)
    torch.testing.assert_close(fast.double(), slow, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dim,levels", [(16, 3), (8, 3), (12, 2), (4, 5)])
def test_tricl_nested_terms_match_reference_loop(dim, levels):
    """Deeper nesting (m down to 1 on D=8), a D that does not halve evenly (12 -> 6, 3), and
    more levels than D allows (4 -> 2, 1: stops at one dimension)."""
    image, text, s, w = _inputs(6, dim, 9.0, seed=dim + levels)
    opts = {"dec_weight": 0.0, "nested": levels, "nested_weight": 2.0}
    fast, _ = _fast("tricl", opts, image, text, s, w)
    slow = ref_tricl(image, text, s, w, 0.0, 0.0) + ref_nested(image, text, s, w, levels, 2.0)
    torch.testing.assert_close(fast, slow, rtol=1e-9, atol=1e-9)
    leaves = [image, text, s, w]
    for got, want in zip(_grads(fast, leaves), _grads(slow, leaves)):
        torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-10)


def test_reference_loops_agree_with_textbook_forms():
    """Sanity of the loops themselves: the infonce loop is torch's cross-entropy, tau_plus=0 of the
    debiased loop is the infonce loop, and a collapsed batch has decorrelation 1 - 1/D."""
    image, text, s, _ = _inputs(5, 7, 3.0, seed=5)
    logits = s * image @ text.t()
    labels = torch.arange(5)
    ce = 0.5 * (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels))
    torch.testing.assert_close(ref_infonce(image, text, s), ce)
    torch.testing.assert_close(ref_debiased(image, text, s, 0.0), ce)
    collapsed = F.normalize(torch.ones(4, 7, dtype=torch.float64), dim=1)
    torch.testing.assert_close(ref_decorrelation(collapsed), torch.tensor(1 - 1 / 7, dtype=torch.float64))
    assert math.isclose(float(ref_decorrelation(torch.eye(7, dtype=torch.float64))), 0.0, abs_tol=1e-15)
