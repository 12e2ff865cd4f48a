"""``--api run``: text searches through Gradio's direct route ``gradio_api/run/search_text``.

The app's ``search_text`` is a batched event; Gradio answers a plain sample posted there
with HTTP 500, so the load test sends a batch of one. An app started with ``batch=1``
(not batched) takes the plain sample.
"""

from __future__ import annotations

import os

import httpx
import pytest

from benchmarks.load_app import LoadConfig, run_body, run_load, run_outputs, text_batched
from tests.app.conftest import free_port


@pytest.fixture(scope="module")
def unbatched_url(app_index):
    """The app over ``app_index`` with text batching off (``batch=1``)."""
    from triclip.app.gradio_app import AppConfig, build_app, launch
    from triclip.index.search import Searcher

    port = free_port()
    blocks, app = build_app(Searcher.load(app_index), AppConfig(index=str(app_index), port=port, batch=1))
    launch(blocks, app, "127.0.0.1", port, block=False)
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        blocks.close()


@pytest.mark.parametrize("which", ["batched", "unbatched"])
def test_a_run_route_request_returns_results(app_url, unbatched_url, which):
    url = app_url if which == "batched" else unbatched_url
    assert text_batched(url) == (which == "batched")
    cfg = LoadConfig(url, m=16, k=4, api="run", run_batched=text_batched(url))
    answer = httpx.post(url + "gradio_api/run/search_text", json=run_body("a red circle", 16, cfg, "t-1"), timeout=30)
    assert answer.status_code == 200, answer.text[:200]
    gallery, status = run_outputs(answer.json(), cfg)[:2]
    assert len(gallery) == 4 and all(item["image"]["url"].startswith(url) for item in gallery)
    assert " ms" in status


@pytest.mark.parametrize("client", ["async", "threads"])
def test_a_short_run_load_answers_every_query(app_url, client):
    cfg = LoadConfig(app_url, clients=3, seconds=1.5, m=8, k=4, client=client, server_pid=os.getpid(), api="run")
    out = run_load(cfg)
    assert out["errors"] == 0, out["error_kinds"]
    assert out["queries"] > 0 and out["api"] == "run" and out["app_search_p50_ms"] is not None
