"""benchmarks.eq6_scale: P, N and the best rescaling of S agree with the loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from benchmarks.eq6_scale import scale_stats
from triclip.losses import build_loss


def test_best_rescaling_of_s_is_p_over_n_and_matches_the_loss():
    g = torch.Generator().manual_seed(0)
    image = F.normalize(torch.randn(12, 6, generator=g, dtype=torch.float64), dim=1)
    text = F.normalize(image + 0.5 * torch.randn(12, 6, generator=g, dtype=torch.float64), dim=1)
    w = 0.5 + torch.rand(6, generator=g, dtype=torch.float64)
    stats = scale_stats(image, text, w)
    loss = build_loss("tricl_spectral")
    terms = loss(image, text, 1.0, w)
    assert stats["L_tri"] == pytest.approx(float(terms["spectral_loss"]), rel=1e-12)
    assert 0.5 * (stats["L_dec_image"] + stats["L_dec_text"]) == pytest.approx(float(terms["decorrelation_loss"]))
    assert stats["L_tri"] == pytest.approx(-2 * stats["P"] + stats["N"], rel=1e-12)
    at_best = float(loss(image, text, 1.0, stats["c_star"] * w)["spectral_loss"])
    assert at_best == pytest.approx(stats["L_tri_at_c_star"], rel=1e-9) and at_best <= stats["L_tri"]
    for c in (0.9, 1.1):
        assert float(loss(image, text, 1.0, c * stats["c_star"] * w)["spectral_loss"]) > at_best
    assert stats["mean_w"] == pytest.approx(float(w.mean())) and 1.0 <= stats["top_eig_image"] <= 6.0
