"""The app and byte budgets: bytes per image and index size beside every choice, the codes of
a budget searched from the page and the JSON route, the frontier chart, and the panels following the version."""

from __future__ import annotations

import httpx
import pytest

from tests.app.conftest import serving, small_index

QUERY = "two red circles"


def _label(entry: dict) -> str:
    from triclip.codecs import CodecSpec

    return CodecSpec.from_json(entry["spec"]).label()


@pytest.fixture(scope="module")
def bytes_index(tmp_path_factory):
    return small_index(tmp_path_factory.mktemp("bytes"), num=60, bytes=[4, 8])


def test_every_choice_shows_bytes_size_and_recall_and_a_budget_searches_its_codes(bytes_index):
    from triclip.app.endpoints import AppConfig, SearchApp
    from triclip.app.panels import choices_text, frontier_figure, frontier_text, m_choices
    from triclip.index.search import Searcher

    searcher = Searcher.load(bytes_index)
    app = SearchApp(searcher, AppConfig(index=str(bytes_index), follow=0))
    view = app.live.view()
    choices = dict((value, label) for label, value in m_choices(view))
    n = len(searcher)
    assert list(choices) == [8, 16, 32, "4B", "8B"]
    assert choices[32].startswith("m = 32 = D · 128 B/image") and f"{128 * n / 1024:.1f} KB" in choices[32]
    assert choices[8].startswith("m = 8 · 32 B/image")
    float_ms = searcher.manifest["budgets"]["4"]["float_latency"]["ms"]
    assert choices[32].endswith(f" · {float_ms:.3g} ms") and " ms" not in choices[8] + choices[16]  # timed at D only
    for budget in (4, 8):
        entry = searcher.manifest["budgets"][str(budget)]
        label = choices[f"{budget}B"]
        assert label.startswith(f"{budget} B budget: {_label(entry)}") and f"R@10 {entry['recall']:.3f}" in label
        assert f", {entry['bytes_per_vector']} B/image stored" in label  # the bytes the code stores, not the budget
        assert label.endswith(f" · {entry['latency']['ms']:.3g} ms")  # the latency the build measured at this size
        row = next(line for line in frontier_text(view).splitlines() if line.startswith(f"| {budget} B |"))
        assert f"| {entry['latency']['ms']:.3g} ({entry['latency']['how']}) |" in row  # the bytes panel's column
        stage = entry["rescore"]  # the float rows a re-rank reads, and from where; none without one
        assert row.endswith(f" from {stage['reads']} |" if stage else "| – |")
    assert "| ms per query | RAM | re-rank reads per query |" in frontier_text(view)
    items, status, ids = app.search_text(QUERY, "8B", False, 5)
    expected = [h["id"] for h in searcher.search_text([QUERY], k=5, bytes=8)[0]]
    assert ids == expected and "8 B per image" in status and "re-scored" not in status
    timed = searcher.manifest["budgets"]["8"]["latency"]["ms"]  # the build's timing and this query's, each named
    assert f", {timed:.3g} ms a query as the build timed it" in status and " · answered in " in status
    assert f"| {timed:.3g} |" in next(line for line in choices_text(view).splitlines() if line.startswith("| 8 B budget"))
    _, status, ids = app.search_text(QUERY, "8B", True, 5)
    assert ids == [h["id"] for h in searcher.search_text([QUERY], k=5, bytes=8, rescore="float")[0]]
    assert "re-scored at D = 32" in status
    _, status, _ = app.search_text(QUERY, "5B", False, 5)
    assert "bytes must be one of [4, 8]" in status
    assert "the codes this index stores (4 B →" in frontier_text(view) and frontier_figure(view) is not None
    assert "Right: image→text recall@10 of the caption codes the same budgets store (4 B →" in frontier_text(view)
    assert "dashed grey: float pruning, the first m dimensions kept" in frontier_text(view)  # every line explained
    figure = frontier_figure(view)
    t2i, i2t = figure.axes  # two charts: text->image and image->text apart
    assert "text→image" in t2i.get_title() and "image→text" in i2t.get_title()
    assert t2i.get_xlabel() == i2t.get_xlabel() == "B/image (bytes stored per image)"  # the page's unit words
    assert t2i.get_legend() is None and len(figure.legends) == 1  # one legend, outside both charts
    for ax, side in ((t2i, searcher.manifest["budgets"]), (i2t, {b: e["text"] for b, e in searcher.manifest["budgets"].items()})):
        lines = {line.get_label(): line for line in ax.get_lines()}
        drawn = sorted(zip(*lines["stored in this index"].get_data()))
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
    assert f"8 B per caption: {_label(entry)}" in status and f"i2t recall@10 {entry['recall']:.3f}" in status
    rows, status = app.image_to_text(image, "8B", True, 5)
    assert list(rows["caption"]) == [h["caption"] for h in
                                     searcher.search_image([image], k=5, target="text", bytes=8, rescore="float")[0]]
    assert "re-scored at D = 32" in status
    _, status = app.image_to_text(image, 32, False, 5)  # full D: the image->text figure, never text->image's
    i2t = app.live.view().curves["text_bytes"]["full_d"]
    assert f"m = 32 = D (i2t recall@10 {i2t:.3f})" in status and i2t != searcher.manifest["recall"]["32"]
    _, status = app.image_to_text(image, 16, False, 5)  # not measured at m < D: said, not borrowed
    assert "i2t recall@10 not measured here" in status


def test_the_choices_table_says_what_each_choice_costs_and_keeps(bytes_index):
    from triclip.app.endpoints import AppConfig, SearchApp
    from triclip.app.panels import choices_text
    from triclip.codecs import CodecSpec, describe
    from triclip.index.search import Searcher

    searcher = Searcher.load(bytes_index)
    view = SearchApp(searcher, AppConfig(index=str(bytes_index), follow=0)).live.view()
    text = choices_text(view)
    header = text.splitlines()[0]
    assert all(word in header for word in ("stored per image", "index size", "text→image R@10", "image→text R@10",
                                           "ms / query"))
    for budget, entry in searcher.manifest["budgets"].items():
        assert describe(CodecSpec.from_json(entry["spec"])) in text  # each code in plain words
        row = next(line for line in text.splitlines() if line.startswith(f"| {budget} B budget |"))
        assert f"| {entry['bytes_per_vector']} B |" in row and f"{entry['text']['recall']:.3f}" in row
        assert f"| {entry['latency']['ms']:.3g} |" in row  # the latency the build recorded, in its own column
    float_ms = searcher.manifest["budgets"]["4"]["float_latency"]["ms"]  # the float scan the codes were held to
    assert float_ms > 0 and all(e["float_latency"]["ms"] == float_ms for e in searcher.manifest["budgets"].values())
    full = next(line for line in text.splitlines() if line.startswith(f"| m = {view.dim} (full D) |"))
    assert full.endswith(f"| {float_ms:.3g} |")  # full D beside the codes: the scan they were held to
    assert all(line.endswith("| – |") for line in text.splitlines() if line.startswith("| m = ") and "full D" not in line)
    assert "± about 0." in text and "by chance" in text  # the noise of a measured recall, said


def test_a_budget_that_stores_a_smaller_budgets_code_says_so_in_plain_words(bytes_index):
    """Where ``index build`` kept a smaller budget's code for a larger one (it ranked above every candidate of the
    larger), the choices and the table name the smaller budget; a budget with a code of its own says nothing of it."""
    from triclip.app.endpoints import AppConfig, SearchApp
    from triclip.app.panels import choices_text, m_choices
    from triclip.index.search import Searcher

    view = SearchApp(Searcher.load(bytes_index), AppConfig(index=str(bytes_index), follow=0)).live.view()
    budgets = view.searcher.manifest["budgets"]  # this test's own Searcher: changed below as a build could write it
    shared = budgets["8"]["spec"] == budgets["4"]["spec"]  # this build's own choice, either way
    budgets["16"] = {**budgets["8"], "note": "the 8 B budget's code ranks above every 16 B candidate: kept here too"}
    labels = dict((value, label) for label, value in m_choices(view))
    words = {b: next(line for line in choices_text(view).splitlines() if line.startswith(f"- **{b} B budget**"))
             for b in (4, 8, 16)}
    assert "same code" not in labels["4B"] + words[4]  # the smallest budget's code is its own
    assert ("(same code as 4 B)" in labels["8B"]) == shared == ("The same code as the 4 B budget" in words[8])
    twin = 4 if shared else 8  # the smallest budget storing it is named
    assert labels["16B"].startswith(f"16 B budget: {_label(budgets['8'])}") and f"(same code as {twin} B)" in labels["16B"]
    assert f"The same code as the {twin} B budget: no code of up to 16 B measured better" in words[16]


def test_the_json_route_takes_bytes(bytes_index):
    with serving(bytes_index) as (url, _):
        route = url + "triclip/api/search_text"
        answer = httpx.get(route, params={"q": QUERY, "bytes": 4, "k": 3}, timeout=60).json()
        spec = answer["code"]
        assert answer["bytes"] == 4 and len(answer["hits"]) == 3 and answer["m"] == spec["m"]  # the code's own m
        assert answer["stored_bytes"] == spec["bytes_per_vector"] <= 4 and spec["label"].startswith(spec["codec"])
        from triclip.index.store import read_manifest

        assert answer["latency_ms"] == read_manifest(bytes_index)["budgets"]["4"]["latency"]["ms"] > 0
        assert httpx.get(route, params={"q": QUERY, "m": 8}, timeout=60).json()["latency_ms"] is None
        full = httpx.get(route, params={"q": QUERY}, timeout=60).json()  # full D: the float scan the build timed
        assert full["bytes"] is None and full["latency_ms"] == read_manifest(bytes_index)["budgets"]["4"]["float_latency"]["ms"] > 0
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
        assert "| 8 B budget |" in drawn["explained"] and "| 4 B budget |" not in drawn["explained"]
        config = httpx.get(url + "config", timeout=30).json()
        shown = {c["props"].get("elem_id") for c in config["components"]}
        assert {"frontier-chart", "frontier-text", "header"} <= shown


def test_lists_tuned_at_n_say_what_they_hold_there(bytes_index):
    """A budget whose inverted lists were tuned at the index's N (the manifest's ``at_n``, ``index build`` at
    N >= IVF_MIN_N) says in the status line, the choices table and the JSON answer what its answers hold there of
    exact search's top 10, at the nprobe kept; a budget without says nothing of it."""
    from triclip.app.endpoints import AppConfig, SearchApp
    from triclip.app.json_api import _searched
    from triclip.app.panels import choices_text
    from triclip.index.search import Searcher

    app = SearchApp(Searcher.load(bytes_index), AppConfig(index=str(bytes_index), follow=0))
    view = app.live.view()
    assert "exact search's top 10" not in choices_text(view) + app._describe(view, "4B", False)
    assert _searched(view, "4B")["at_n"] is None
    curve = [{"nprobe": 1, "of_exact_top10": 0.1, "ms": 0.2}, {"nprobe": 2, "of_exact_top10": 0.248, "ms": 0.31},
             {"nprobe": 4, "of_exact_top10": 0.3, "ms": 0.6}]  # tuned: nprobe 2 kept
    budgets = view.searcher.manifest["budgets"]  # this test's own Searcher: as a build at N would have written it
    budgets["4"] = {**budgets["4"], "at_n": {"n": 1_000_000, "queries": 322, "nprobe": 2, "curve": curve}}
    assert "; 0.248 of exact search's top 10 at N = 1,000,000" in app._describe(view, "4B", False)
    assert "Among all 1,000,000 images its answers hold 0.248 of exact full-D search's top 10" in choices_text(view)
    assert _searched(view, "4B")["at_n"] == {"n": 1_000_000, "queries": 322, "of_exact_top10": 0.248}
    assert _searched(view, "8B")["at_n"] is None
