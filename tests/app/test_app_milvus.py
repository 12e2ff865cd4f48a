"""The app over a Milvus collection (``triclip app --index PATH.db``): the JSON route and a Gradio endpoint
answer as the app over the index folder does, the header says where the hits come from, images are served."""

from __future__ import annotations

import httpx
import pytest
from gradio_client import Client

from tests.app.conftest import free_port
from triclip.index.config import ExportConfig
from triclip.index.milvus_export import export


@pytest.fixture(scope="module")
def exported(app_index, tmp_path_factory) -> str:
    db = str(tmp_path_factory.mktemp("milvus_app") / "app.db")
    export(ExportConfig(index=str(app_index), to=db))
    return db


@pytest.fixture(scope="module")
def both(app_index, exported):
    """The app over the index folder and the app over its Milvus export, each on a free port: (local URL, Milvus URL, Milvus app)."""
    from triclip.app.gradio_app import AppConfig, build_app, launch
    from triclip.index.milvus_search import open_searcher

    served = []
    try:
        for index in (str(app_index), exported):
            port = free_port()
            blocks, app = build_app(open_searcher(index), AppConfig(index=index, port=port))
            launch(blocks, app, "127.0.0.1", port, block=False)
            served.append((blocks, app, f"http://127.0.0.1:{port}/"))
        yield served[0][2], served[1][2], served[1][1]
    finally:
        for blocks, app, _ in served:
            blocks.close()
        if len(served) > 1:
            served[1][1].searcher.close()  # Milvus Lite's .db is free again


def test_the_header_says_it_serves_from_milvus(both, exported):
    from triclip.app.panels import header_text, m_choices

    _, _, app = both
    view = app.live.view()
    header = header_text(view)
    assert f"served from Milvus Lite {exported}, collection triclip (FLAT, m = 32)" in header
    assert "version v000001" in header and "images · D = 32" in header
    choices = m_choices(view)
    assert [value for _, value in choices] == [32] and "Milvus FLAT · 128 B/image" in choices[0][0]


def test_the_json_route_answers_as_the_local_app(both):
    local, milvus, _ = both
    for query in ("two red circles", "a small green triangle at the bottom"):
        want = httpx.get(local + "triclip/api/search_text", params={"q": query, "k": 8}, timeout=60).json()
        got = httpx.get(milvus + "triclip/api/search_text", params={"q": query, "k": 8}, timeout=60).json()
        assert [(round(h["score"], 4), h["caption"]) for h in got["hits"]] == [
            (round(h["score"], 4), h["caption"]) for h in want["hits"]]
        assert got["m"] == 32 and got["version"] == "v000001" and len(got["hits"]) == 8
        image = httpx.get(got["hits"][0]["image"], timeout=60)  # the app's image route, row looked up in Milvus
        assert image.status_code == 200 and image.headers["content-type"] == "image/png"
        assert image.content == httpx.get(want["hits"][0]["image"], timeout=60).content
    bad = httpx.get(milvus + "triclip/api/search_text", params={"q": "x", "m": 16}, timeout=60)
    assert bad.status_code == 400 and "m must be one of [32]" in bad.json()["error"]


def test_a_gradio_endpoint_answers_from_milvus(both):
    local, milvus, _ = both
    ask = lambda url, *args, api: Client(url, verbose=False, download_files=False).predict(*args, api_name=api)  # noqa: E731
    gallery, status = ask(milvus, "three blue squares", 32, False, 5, api="/search_text")
    want, _ = ask(local, "three blue squares", 32, False, 5, api="/search_text")
    assert "**5 results**" in status and [g["caption"] for g in gallery] == [g["caption"] for g in want]
    some_id = httpx.get(milvus + "triclip/api/search_text", params={"q": "two red circles", "k": 1}, timeout=60).json()
    some_id = some_id["hits"][0]["id"]
    gallery, status = ask(milvus, some_id, 32, False, 3, api="/more_like_this")
    assert f"**3 results** for image {some_id}" in status and gallery[0]["caption"].startswith("1.000")  # itself first
    _, status = ask(milvus, "no/such/id", 32, False, 3, api="/more_like_this")
    assert "unknown id" in status
