"""``triclip.app.gradio_patches`` against the installed Gradio: each override still replaces what it was written for.

No server: the components and the Blocks are made here and their methods called directly. The
internals they replace are named and their signatures checked in test_gradio_internals.py.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import gradio as gr
import pytest
from gradio.data_classes import FileData
from gradio.utils import get_upload_folder

from triclip.app.gradio_patches import GRADIO_VERSION, gallery_wire, guard_inputs, loose, query_image, result_gallery

ROOT = Path(__file__).resolve().parents[2]
URLS = [("http://127.0.0.1:7860/triclip/image/12", "0.512 · a cat"), ("http://127.0.0.1:7860/triclip/image/3", "x")]


def test_the_version_recorded_is_the_one_installs_pin():
    """GRADIO_VERSION moves with constraints.txt; the names and signatures themselves: test_gradio_internals.py."""
    pins = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().split() if "==" in line)
    assert pins["gradio"] == GRADIO_VERSION


def test_result_gallery_serialises_url_results_as_gradio_does():
    with gr.Blocks():
        ours, theirs = result_gallery(label="a"), gr.Gallery(label="b")
    assert ours.postprocess(URLS).model_dump() == theirs.postprocess(URLS).model_dump()
    assert ours.postprocess([]).model_dump() == theirs.postprocess([]).model_dump() == []
    assert ours.postprocess(None).model_dump() == []  # anything else: Gradio's own code
    assert gallery_wire(URLS) == theirs.postprocess(URLS).model_dump()  # what the text search sends, built directly


def test_query_image_passes_an_upload_undecoded_and_refuses_a_server_path():
    with gr.Blocks():
        image = query_image(label="q")
    upload = os.path.join(get_upload_folder(), "abc", "not-an-image.png")  # never opened: no file needed
    assert image.preprocess(FileData(path=upload)) == upload
    assert image.preprocess(None) is None
    with pytest.raises(gr.Error, match="must be uploaded"):
        image.preprocess(FileData(path="/etc/passwd"))


def test_loose_lets_a_value_through_that_the_component_refuses():
    with pytest.raises(gr.Error):
        gr.Radio([8, 16]).preprocess("99")  # what the override is for
    assert loose(gr.Radio([8, 16])).preprocess("99") == "99"
    assert loose(gr.Slider(1, 100)).preprocess("7") == "7"


def test_guard_inputs_names_the_endpoint_and_its_inputs():
    with gr.Blocks() as blocks:
        text, m = gr.Textbox(label="query"), gr.Radio([8, 16], label="m")
        gr.Button().click(lambda q, k: q, [text, m], text, api_name="echo")
    block_fn = next(iter(blocks.fns.values()))
    with pytest.raises(Exception) as plain:  # Gradio's own: a bare exception (the client sees {"error": null})
        asyncio.run(blocks.preprocess_data(block_fn, ["x"], None))
    assert not isinstance(plain.value, gr.Error)
    guard_inputs(blocks)
    with pytest.raises(gr.Error, match=r"malformed request to /echo \(inputs: query, m\)"):
        asyncio.run(blocks.preprocess_data(block_fn, ["x"], None))


def test_set_choices_reaches_the_config_and_the_api_info_of_a_launched_app():
    """No server here either: ``blocks.config`` as launch makes it, and the API info Gradio makes from it."""
    from triclip.app.gradio_patches import set_choices

    with gr.Blocks() as blocks:
        radio = loose(gr.Radio([("eight", 8), ("four bytes", "4B")], value=8, label="m"))
        out = gr.Textbox()
        radio.change(lambda m: str(m), radio, out, api_name="pick")
    blocks.config = blocks.get_config_file()  # what launch() does

    def shown():
        entry = next(c for c in blocks.config["components"] if c["id"] == radio._id)
        return entry["props"]["choices"], blocks.get_api_info()["named_endpoints"]["/pick"]["parameters"][0]["type"]

    assert shown()[1]["enum"] == [8, "4B"]
    set_choices(blocks, radio, [("sixteen", 16), ("eight bytes", "8B")], 16)
    choices, api = shown()
    assert [value for _, value in choices] == [16, "8B"] and api["enum"] == [16, "8B"]
    assert radio.value == 16


def test_launch_waits_for_its_servers_first_answer_and_says_so_in_one_line_when_none_comes(app_index, monkeypatch):
    """Gradio's launch asks its new server once, with a 3 s timeout, and otherwise refuses to serve with a message
    about share links; ours asks again until LOCALHOST_PATIENCE, then one line."""
    import httpx
    from gradio import networking

    from triclip.app import gradio_patches
    from triclip.core.errors import UserError
    from tests.app.conftest import serving

    head, asked, once = httpx.head, [], networking.url_ok

    def slow(url, **kwargs):  # the first two checks time out, as on a busy machine
        asked.append(url)
        if len(asked) <= 2:
            raise httpx.ReadTimeout("timed out")
        return head(url, **kwargs)

    monkeypatch.setattr(httpx, "head", slow)
    with serving(app_index) as (url, _):
        assert httpx.get(url + "triclip/api/search_text", params={"q": "a red apple", "k": 2}, timeout=60).status_code == 200
    assert len(asked) == 3 and networking.url_ok is once  # Gradio's check put back after the launch

    monkeypatch.setattr(httpx, "head", lambda url, **kwargs: (_ for _ in ()).throw(httpx.ReadTimeout("timed out")))
    monkeypatch.setattr(gradio_patches, "LOCALHOST_PATIENCE", 1.0)
    with pytest.raises(UserError) as err:
        with serving(app_index):
            pass
    assert "did not answer on localhost within 1 s" in str(err.value) and "\n" not in str(err.value)


def test_the_app_starts_behind_an_http_proxy(app_index, monkeypatch):
    """Gradio's launch checks its server through httpx, which honours HTTP_PROXY: a proxy that refuses (or does not
    know 127.0.0.1) ended the launch in a traceback. Requests to the served host and to localhost now go direct."""
    import httpx

    from tests.app.conftest import serving

    for key in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(key, "http://127.0.0.1:9")  # discard port: nothing listens there
    for key in ("NO_PROXY", "no_proxy"):
        monkeypatch.setenv(key, "example.org")
    with serving(app_index) as (url, _):
        answer = httpx.get(url + "triclip/api/search_text", params={"q": "a red apple", "k": 2}, timeout=60)
        assert answer.status_code == 200 and len(answer.json()["hits"]) == 2  # a proxied client would be refused
    assert os.environ["NO_PROXY"].split(",")[:2] == ["example.org", "127.0.0.1"]  # the user's own entries first
