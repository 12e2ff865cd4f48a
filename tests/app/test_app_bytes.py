"""The app and byte budgets: bytes per image and index size beside every choice, the codes of
a budget searched from the page and the JSON route, the frontier chart, and the panels following the version."""

from __future__ import annotations

import httpx
import pytest

from tests.app.conftest import serving, small_index

QUERY = "two red circles"


@pytest.fixture(scope="module")
def bytes_index(tmp_path_factory):
    return small_index(tmp_path_factory.mktemp("bytes"), num=60, bytes=[4, 8])


def test_every_choice_shows_bytes_size_and_recall_and_a_budget_searches_its_codes(bytes_index):
    from triclip.app.endpoints import AppConfig, SearchApp
    from triclip.app.panels import frontier_figure, frontier_text, m_choices
    from triclip.index.search import Searcher

    searcher = Searcher.load(bytes_index)
    app = SearchApp(searcher, AppConfig(index=str(bytes_index), follow=0))
    view = app.live.view()
    choices = dict((value, label) for label, value in m_choices(view))
    n = len(searcher)
    assert list(choices) == [8, 16, 32, "4B", "8B"]
    assert "32 = D · 128 B/image" in choices[32] and f"{128 * n / 1024:.1f} KB" in choices[32]
    for budget in (4, 8):
        entry = searcher.manifest["budgets"][str(budget)]
        label = choices[f"{budget}B"]
        assert label.startswith(f"{budget} B: {entry['spec']['codec']}") and f"R@10 {entry['recall']:.3f}" in label
    items, status, ids = app.search_text(QUERY, "8B", False, 5)
    expected = [h["id"] for h in searcher.search_text([QUERY], k=5, bytes=8)[0]]
    assert ids == expected and "8 B per image" in status and "re-scored" not in status
    _, status, ids = app.search_text(QUERY, "8B", True, 5)
    assert ids == [h["id"] for h in searcher.search_text([QUERY], k=5, bytes=8, rescore="float")[0]]
    assert "re-scored at D = 32" in status
    _, status, _ = app.search_text(QUERY, "5B", False, 5)
    assert "bytes must be one of [4, 8]" in status
    assert "the codes this index stores (4 B →" in frontier_text(view) and frontier_figure(view) is not None
    assert "Image→text searches the caption codes of the same budgets, by i2t recall@10: 4 B →" in frontier_text(view)
    lines = {line.get_label(): line for line in frontier_figure(view).axes[0].get_lines()}
    for label, side in (("this index's image codes", searcher.manifest["budgets"]),
                        ("its caption codes (image→text recall@10)", {b: e["text"] for b, e in searcher.manifest["budgets"].items()})):
        drawn = sorted(zip(*lines[label].get_data()))
        assert drawn == sorted((side[b]["bytes_per_vector"], side[b]["recall"]) for b in ("4", "8"))  # codes' own bytes


def test_image_to_text_by_a_budget_searches_its_caption_codes(bytes_index):
    import json

    from triclip.app.endpoints import AppConfig, SearchApp
    from triclip.index.search import Searcher

    searcher = Searcher.load(bytes_index)
    app = SearchApp(searcher, AppConfig(index=str(bytes_index), follow=0))
    data = bytes_index.parent / "data"
    image = str(data / json.loads((data / "train.jsonl").read_text().splitlines()[0])["image"])
    rows, status = app.image_to_text(image, "8B", False, 5)
    expected = searcher.search_image([image], k=5, target="text", bytes=8)[0]
    assert list(rows["caption"]) == [h["caption"] for h in expected] and len(rows) == 5
    entry = searcher.manifest["budgets"]["8"]["text"]
    assert f"8 B per caption: {entry['spec']['codec']}" in status and f"i2t recall@10 {entry['recall']:.3f}" in status
    rows, status = app.image_to_text(image, "8B", True, 5)
    assert list(rows["caption"]) == [h["caption"] for h in
                                     searcher.search_image([image], k=5, target="text", bytes=8, rescore="float")[0]]
    assert "re-scored at D = 32" in status


def test_the_json_route_takes_bytes(bytes_index):
    with serving(bytes_index) as (url, _):
        route = url + "triclip/api/search_text"
        answer = httpx.get(route, params={"q": QUERY, "bytes": 4, "k": 3}, timeout=60).json()
        assert answer["bytes"] == 4 and len(answer["hits"]) == 3 and answer["m"] >= 1
        bad = httpx.get(route, params={"q": QUERY, "bytes": 6}, timeout=60)
        assert bad.status_code == 400 and "bytes must be one of [4, 8]" in bad.json()["error"]
        both = httpx.get(route, params={"q": QUERY, "bytes": 4, "m": 8}, timeout=60)
        assert both.status_code == 400 and "not both" in both.json()["error"]


def test_header_choices_and_panels_follow_an_overwrite(tmp_path):
    import time

    from triclip.app.gradio_app import redraw
    from triclip.index.sources import IndexBuildConfig, build_index

    index = small_index(tmp_path, num=40, bytes=[4])
    with serving(index, follow=0.1) as (url, app):
        first = app.live.view()
        assert redraw(app, first.version, "4B") == {}  # the version shown: nothing redrawn
        build_index(IndexBuildConfig(run=str(tmp_path / "run"), data=str(tmp_path / "data" / "train.jsonl"),
                                     out=str(index), dims=[8], bytes=[8], overwrite=True))
        deadline = time.monotonic() + 60
        while app.live.view().version == first.version and time.monotonic() < deadline:
            time.sleep(0.1)
        drawn = redraw(app, first.version, "4B")
        version, m = drawn["version"], drawn["m"]
        assert version != first.version and f"version {version}" in drawn["header"]
        assert [value for _, value in m["choices"]] == [8, 32, "8B"] and m["value"] == 32  # 4B is gone: back to D
        assert "(8 B →" in drawn["frontier"] and drawn["frontier_plot"]["visible"] is True
        config = httpx.get(url + "config", timeout=30).json()
        shown = {c["props"].get("elem_id") for c in config["components"]}
        assert {"frontier-chart", "frontier-text", "header"} <= shown
