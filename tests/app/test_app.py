"""The search app through its API (gradio_client): named endpoints, results, bad input."""

from __future__ import annotations

import subprocess
import sys
from urllib.parse import urlparse

import httpx
import pytest
from gradio_client import Client, handle_file

from triclip.app.endpoints import ENDPOINTS


@pytest.fixture(scope="module")
def client(app_url) -> Client:
    return Client(app_url, verbose=False, download_files=False)


def _path(url: str) -> str:
    """An image URL's path (without its ``?v=<version>``)."""
    return urlparse(url).path


def _search(client, query, m=32, funnel=False, k=5):
    return client.predict(query, m, funnel, k, api_name="/search_text")


def test_named_endpoints_are_listed(client):
    api = client.view_api(print_info=False, return_format="dict")
    assert {f"/{name}" for name in ENDPOINTS} <= set(api["named_endpoints"])


def test_text_search_returns_served_images_with_score_labels(client, app_url):
    gallery, status = _search(client, "two red circles", k=5)
    assert len(gallery) == 5 and status.startswith("**5 results**") and " ms" in status
    scores = [float(item["caption"].split(" · ")[0]) for item in gallery]
    assert scores == sorted(scores, reverse=True)
    url = gallery[0]["image"]["url"]
    assert url.startswith(app_url + "triclip/image/")  # served by the app's own image route
    response = httpx.get(url)
    assert response.status_code == 200 and response.content[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_default_client_downloads_the_result_images(app_url, tmp_path):
    """gradio_client's default (download_files=True) fetches each result through Gradio's file route."""
    default = Client(app_url, verbose=False, download_files=str(tmp_path))
    gallery, status = default.predict("two red circles", 32, False, 3, api_name="/search_text")
    assert len(gallery) == 3 and status.startswith("**3 results**")
    for item in gallery:
        with open(item["image"], "rb") as fh:  # a local copy of the served PNG
            assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    foreign = httpx.get(app_url + "gradio_api/file=http://example.invalid/etc/passwd")
    assert foreign.status_code == 404  # only the index's own images answer on that route


def test_the_image_route_serves_indexed_images_only(app_url, app_index):
    from triclip.index.store import load_contents

    count = len(load_contents(app_index).meta)
    assert httpx.get(f"{app_url}triclip/image/{count - 1}").status_code == 200
    for path in (f"triclip/image/{count}", "triclip/image/-1", "triclip/image/..%2F..%2Fetc%2Fpasswd", "triclip/image/x"):
        assert httpx.get(app_url + path).status_code == 404, path


def test_m_and_funnel_choose_the_index_searched(client):
    _, at_8 = _search(client, "a blue square", m=8)
    _, funnel = _search(client, "a blue square", m=8, funnel=True)
    _, full = _search(client, "a blue square", m=32)
    assert "m = 8" in at_8 and "funnel: shortlist at m = 8" in funnel and "m = 32 = D" in full
    gallery, status = _search(client, "a blue square", m=12)  # an m the folder has no index for
    assert gallery == [] and "m must be one of [8, 16, 32], got 12" in status


def test_more_like_this_ranks_the_clicked_image_first(client, app_index):
    from triclip.index.store import load_contents

    some_id = load_contents(app_index).meta[3]["id"]
    gallery, status = client.predict(some_id, 16, False, 4, api_name="/more_like_this")
    assert len(gallery) == 4 and f"image {some_id}" in status
    assert _path(gallery[0]["image"]["url"]).endswith("/triclip/image/3")  # row 3 itself first
    _, unknown = client.predict("no/such/image.png", 16, False, 4, api_name="/more_like_this")
    assert "⚠️" in unknown and "unknown id" in unknown


def test_image_search_and_image_to_text(client, app_index):
    from triclip.index.store import load_contents

    row = load_contents(app_index).meta[5]
    gallery, status = client.predict(handle_file(row["image"]), 32, False, 3, api_name="/search_image")
    assert len(gallery) == 3 and "the uploaded image" in status
    assert _path(gallery[0]["image"]["url"]).endswith("/triclip/image/5")  # itself (row 5), at the top
    rows, status = client.predict(handle_file(row["image"]), 32, False, 5, api_name="/image_to_text")
    assert len(rows["data"]) == 5 and rows["headers"] == ["score", "caption", "image id"]
    assert "5 captions" in status


def test_bad_input_gives_a_message_and_the_app_keeps_serving(client, not_an_image, bomb):
    gallery, status = _search(client, "   ")
    assert gallery == [] and status == "⚠️ Type a query first: the text is empty."
    gallery, status = client.predict(handle_file(not_an_image), 32, False, 5, api_name="/search_image")
    assert gallery == [] and "notes.png is not an image that can be read" in status
    gallery, status = client.predict(handle_file(bomb), 32, False, 5, api_name="/search_image")
    assert gallery == [] and "bomb.png has too many pixels" in status
    rows, status = client.predict(handle_file(not_an_image), 32, False, 5, api_name="/image_to_text")
    assert rows["data"] == [] or rows["data"] == [[]] or not any(rows["data"])
    assert "not an image" in status
    gallery, status = _search(client, "red " * 25_000)  # 100,000 characters
    assert len(gallery) == 5 and "query cut to its first 1,000 characters" in status
    assert "Traceback" not in status
    gallery, _ = _search(client, "a green star")  # still serving
    assert len(gallery) == 5


def test_cli_app_on_a_missing_index_is_one_line_exit_2(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "triclip", "app", "--index", str(tmp_path / "nothing")], capture_output=True, text=True
    )
    assert result.returncode == 2
    assert result.stderr.startswith("triclip: error:") and len(result.stderr.strip().splitlines()) == 1


def test_set_threads_sets_torch_and_faiss_threads():
    import faiss
    import torch

    from triclip.app.server import set_threads

    before = torch.get_num_threads()
    try:
        set_threads(1)
        assert torch.get_num_threads() == 1 and faiss.omp_get_max_threads() == 1
    finally:
        torch.set_num_threads(before)
        faiss.omp_set_num_threads(before)


def test_json_route_answers_as_the_searcher_does(app_url, app_index):
    from triclip.index.search import Searcher

    searcher = Searcher.load(app_index)
    answer = httpx.get(app_url + "triclip/api/search_text", params={"q": "two red circles", "m": 16, "k": 4}).json()
    want = searcher.search_text(["two red circles"], k=4, m=16)[0]
    assert answer["m"] == 16 and answer["funnel"] is False and answer["ms"] > 0
    assert [h["id"] for h in answer["hits"]] == [h["id"] for h in want]
    assert [h["score"] for h in answer["hits"]] == pytest.approx([h["score"] for h in want], abs=1e-5)
    image = httpx.get(answer["hits"][0]["image"])  # an URL of the app's image route
    assert image.status_code == 200 and image.content[:4] == b"\x89PNG"
    funnel = httpx.get(app_url + "triclip/api/search_text", params={"q": "a blue square", "m": 8, "funnel": 1}).json()
    assert funnel["funnel"] is True and len(funnel["hits"]) == 12  # AppConfig.k by default


@pytest.mark.parametrize(
    "params, needle",
    [({"q": "  "}, "empty query"), ({"q": "x", "m": 7}, "m must be one of"), ({"q": "x", "k": 0}, "k must be between"),
     ({"q": "x", "funnel": "abc"}, "funnel must be 0 or 1"), ({"q": "x", "funnel": 2}, "funnel must be 0 or 1"),
     ({"q": "x", "funnel": -1}, "funnel must be 0 or 1")],  # these were read as false
)
def test_json_route_refuses_bad_input_with_a_400(app_url, params, needle):
    answer = httpx.get(app_url + "triclip/api/search_text", params=params)
    assert answer.status_code == 400 and needle in answer.json()["error"]


@pytest.mark.parametrize("funnel", ["abc", "2", "-1"])
def test_an_endpoint_refuses_a_funnel_that_is_not_a_yes_or_no(client, funnel):
    gallery, status = _search(client, "two red circles", funnel=funnel)
    assert gallery == [] and "funnel must be 0 or 1" in status
    assert len(_search(client, "two red circles", funnel="true")[0]) == 5  # the words still work


def test_json_route_batches_concurrent_queries_and_answers_each_its_own(app_url):
    from concurrent.futures import ThreadPoolExecutor

    texts = [f"{n} {c} {s}" for n in ("one", "two") for c in ("red", "green") for s in ("circles", "squares")]

    def ask(text):
        return httpx.get(app_url + "triclip/api/search_text", params={"q": text, "m": 32, "k": 5}).json()

    alone = [ask(t) for t in texts]
    with ThreadPoolExecutor(len(texts)) as pool:
        together = list(pool.map(ask, texts))
    for a, b, text in zip(alone, together, texts):
        assert b["query"] == text and [h["id"] for h in a["hits"]] == [h["id"] for h in b["hits"]]
