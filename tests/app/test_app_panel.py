"""The feature-selection panel and the m-versus-full-D comparison."""

from __future__ import annotations

import httpx
import pytest
import torch

from triclip.app.panels import recall_figure, recall_text, spectrum_figure, spectrum_text

CURVES = {
    "split": "validation", "queries": 344, "images": 793, "ordering": "importance",
    "curves": {
        "importance": {"8": 0.2, "16": 0.3, "32": 0.4, "64": 0.5},
        "first": {"8": 0.1, "16": 0.2, "32": 0.3, "64": 0.5},
        "random": {"8": 0.1, "16": 0.15, "32": 0.3, "64": 0.5},
        "pca": {"8": 0.25, "16": 0.3, "32": 0.35, "64": 0.5},
    },
}


@pytest.mark.parametrize("w", [[1.0] * 64, [0.37] * 16])
def test_a_run_without_importance_is_said_in_words_not_drawn_flat(w):
    words, suggested, _ = spectrum_text(w, CURVES)
    assert words.startswith("**No learned importance**") and "mrl" in words and suggested is None
    assert spectrum_figure(w, None) is None


@pytest.mark.parametrize("w", [[2.0 ** -i for i in range(64)], [1.0 / (i + 1) for i in range(64)]])
def test_a_spectrum_gives_suggest_ms_m_and_the_recall_measured_at_or_above_it(w):
    from triclip.compact.features import suggest_m

    words, suggested, power = spectrum_text(w, CURVES)
    assert suggested == suggest_m(torch.tensor(w), share=0.9)
    assert f"**Suggested m = {suggested}** (advice: " in words and "predicted to keep 90% of full-D recall" in words
    total = "importance" if power == 1 else f"importance raised to the power {power:g}"
    assert words.count(f"of the total {total}") == 2 and "pick the nearest" not in words  # one total, one rule
    above = min(m for m in (8, 16, 32, 64) if m >= suggested)
    at = CURVES["curves"]["importance"][str(above)]
    where = "there" if above == suggested else f"at m = {above}, the nearest measured m above it"
    assert f"Measured {where}: recall@10 {at:.3f}, {at / 0.5:.0%} of full D's 0.500" in words
    figure = spectrum_figure(w, suggested, power)
    lines = [line for ax in figure.axes for line in ax.get_lines()]
    assert len(lines) == 3  # S, the cumulative share suggest_m reads, the suggested m
    share = next(line for line in lines if line.get_label().startswith("cumulative share")).get_ydata()
    assert share[-1] == pytest.approx(1.0) and share[suggested - 1] >= 0.9 - 1e-9
    assert suggested == 1 or share[suggested - 2] < 0.9  # the plotted share crosses 90% at the suggested m


def test_the_measured_recall_is_quoted_at_the_suggested_m(monkeypatch):
    import triclip.compact.features

    monkeypatch.setattr(triclip.compact.features, "suggest_m", lambda w, share: 32)
    words, suggested, _ = spectrum_text([1.0 / (i + 1) for i in range(64)], CURVES)
    assert suggested == 32 and "Measured there: recall@10 0.400, 80% of full D's 0.500" in words


def test_the_recall_chart_draws_the_four_orderings():
    figure = recall_figure(CURVES, [8, 16, 64])
    labels = [line.get_label() for line in figure.axes[0].get_lines() if not line.get_label().startswith("_")]
    assert labels == ["run's own order", "first-m", "random-m", "PCA-m"]
    assert "344 distinct captions" in recall_text(CURVES, [8, 16, 64]) and "validation" in recall_text(CURVES, [8])
    assert recall_figure(None, [8]) is None and "no recall-against-m curves" in recall_text(None, [8])


def test_choosing_m_shows_full_d_beside_with_the_overlap(app_index):
    from triclip.app.endpoints import AppConfig, SearchApp
    from triclip.index.search import Searcher

    searcher = Searcher.load(app_index)
    app = SearchApp(searcher, AppConfig(index=str(app_index), follow=0))
    items, status, ids = app.search_text("two red circles", "8", False, 10)
    full, note = app.compare(("text", "two red circles"), ids, "8", False, 10)
    at_d = [h["id"] for h in searcher.search_text(["two red circles"], k=10)[0]]
    shared = len(set(ids) & set(at_d))
    assert note.startswith(f"**{shared} of 10 shared** between the results at m = 8") and full["visible"] is True
    assert [url.split("/triclip/image/")[1].split("?")[0] for url, _ in full["value"]] == [
        str(app.live.view().rows[i]) for i in at_d
    ]
    hidden, note = app.compare(("text", "two red circles"), ids, 32, False, 10)
    assert hidden["visible"] is False and "full D" in note


def test_the_page_holds_the_panel_and_no_id_box(app_url):
    config = httpx.get(app_url + "config", timeout=30).json()
    shown = {c["props"].get("elem_id"): c for c in config["components"] if c["props"].get("elem_id")}
    assert "recall-chart" in shown and "Importance S" in shown["spectrum"]["props"]["value"]
    assert "Suggested m = " in shown["spectrum"]["props"]["value"]
    assert shown["clicked-id"]["props"]["visible"] is False  # "more like this" is a click, not a box to type in
    assert shown["results"]["props"]["object_fit"] == "contain"
