"""Where the app reaches into Gradio's internals, in one place, written against ``GRADIO_VERSION``.

Each is an instance override (a subclass of a component would make Gradio write a .pyi
beside this file) or a wire format built by hand, there for a measured reason:

- :func:`query_image`: ``gr.Image.preprocess`` hands the upload's path over undecoded
  and refuses a server path (``gradio.utils.get_upload_folder`` / ``is_in_or_equal``);
- :func:`result_gallery`: ``gr.Gallery.postprocess`` validates our URL results into
  ``GalleryData`` without a thread pool (:func:`gallery_wire`: Gradio's wire format);
- :func:`loose`: ``preprocess`` passes ``m`` and ``k`` to the app unchecked;
- :func:`guard_inputs`: ``Blocks.preprocess_data`` turns a malformed payload into a message;
- :func:`raw_text_search`: the batched text search takes and gives the wire format
  (``preprocess=False, postprocess=False``);
- :func:`set_choices`: a radio's choices changed after launch, in the page's config and the
  API info (Gradio computes both once, at launch, and caches the API info);
- :func:`patient_localhost_check`: ``Blocks.launch`` asks its own new server once (``networking.url_ok``: a HEAD
  with a 3 s timeout) and, when that times out, refuses to serve with a message about share links.

``tests/app/test_gradio_patches.py`` checks each against the installed Gradio (and
``test_gradio_internals.py`` the internals they replace, docs/DEPENDENCIES.md); a new
Gradio version is taken by running both, then moving ``GRADIO_VERSION`` with the pin in
constraints.txt. Gradio's
environment settings (analytics, matplotlib backend) are in ``triclip/app/__init__.py``.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

import gradio as gr

if TYPE_CHECKING:
    from triclip.app.endpoints import SearchApp

GRADIO_VERSION = "6.31.0"  # the Gradio these overrides were written and tested against (constraints.txt)


def query_image(**kwargs) -> gr.Image:
    """A ``gr.Image`` input that hands the uploaded file's path to the app without decoding it.

    ``gr.Image`` opens every upload with Pillow before the app sees it, so a file that is
    not an image, or a decompression bomb, fails inside Gradio with a generic error. This
    one passes the path straight to the Searcher, whose guarded decode turns it into a
    message. A path outside Gradio's upload folder (an API payload such as
    ``{"path": "/etc/passwd"}``, which Gradio lets through) is refused. (An instance
    override: subclassing a component makes Gradio write a .pyi beside this file.)
    """
    from gradio.utils import get_upload_folder, is_in_or_equal

    image = gr.Image(type="filepath", **kwargs)
    decode = image.preprocess

    def preprocess(payload):
        if payload is None:
            return None
        if payload.path is None:  # a data: URL (pasted image): Gradio decodes it to a file
            try:
                return decode(payload)
            except Exception:
                return "<unreadable pasted image>"
        path = str(payload.path)
        if not is_in_or_equal(path, get_upload_folder()):  # an API payload naming a server path, not an upload
            raise gr.Error("the image must be uploaded (a server path is not accepted)", print_exception=False)
        return path

    image.preprocess = preprocess
    return image


def result_gallery(**kwargs) -> gr.Gallery:
    """A ``gr.Gallery`` whose results (``(image URL, caption)`` pairs) are serialised without threads.

    Gradio's ``Gallery.postprocess`` starts a thread pool (and new threads) for every
    answer to prepare its items; for our items, URLs of the image route, there is
    nothing to prepare, and under load those threads cost ~6% of the server's CPU. This
    instance override validates :func:`gallery_wire`'s dicts into the same ``GalleryData``
    in the calling thread (anything else still goes through Gradio's own code). As in :func:`query_image`, an instance override,
    not a subclass.
    """
    from gradio.components.gallery import GalleryData

    gallery = gr.Gallery(**kwargs)
    postprocess = gallery.postprocess

    def urls_only(value):
        if not isinstance(value, list) or not all(is_url_item(item) for item in value):
            return postprocess(value)
        return GalleryData.model_validate(gallery_wire(value))  # one serialisation: gallery_wire's

    gallery.postprocess = urls_only
    return gallery


def loose(component):
    """An input whose API payload reaches the app unchecked (an instance override, as :func:`query_image`).

    Gradio's Radio refuses a value outside its choices and its Slider compares numbers,
    both with a server traceback and an empty error for the client; ``m`` and ``k`` may
    arrive as numeric strings (what ``view_api`` shows), so :class:`SearchApp` checks them
    itself and answers a message.
    """
    component.preprocess = lambda payload: payload
    return component


def guard_inputs(blocks: gr.Blocks) -> gr.Blocks:
    """Malformed API payloads (wrong number of inputs, a value Gradio cannot read) answer a message.

    Gradio raises a plain exception for them, which the client sees as ``{"error": null}``
    and the server log as a traceback; this instance override of ``preprocess_data``
    turns it into a ``gr.Error`` naming the endpoint and its inputs, not printed.
    """
    preprocess = blocks.preprocess_data

    async def checked(block_fn, inputs, state, explicit_call=False):
        try:
            return await preprocess(block_fn, inputs, state, explicit_call)
        except gr.Error:
            raise
        except Exception as err:  # noqa: BLE001 (the client's payload, not our bug)
            wanted = ", ".join(getattr(b, "label", None) or type(b).__name__ for b in block_fn.inputs)
            first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
            name = block_fn.api_name or block_fn.name
            raise gr.Error(f"malformed request to /{name} (inputs: {wanted}): {first}", print_exception=False) from None

    blocks.preprocess_data = checked
    return blocks


def gallery_wire(items: list) -> list[dict]:
    """``(image URL, caption)`` results as Gradio sends a gallery (``GalleryData.model_dump()``), built directly.

    Pydantic models built and dumped per answer were ~7% of the server's CPU under load;
    tests check that this equals Gradio's own serialisation.
    """
    from gradio_client.utils import get_mimetype

    return [
        {
            "image": {
                "path": url, "url": url, "size": None, "orig_name": Path(urlparse(url).path).name,
                "mime_type": get_mimetype(url), "is_stream": False, "meta": {"_type": "gradio.FileData"},
            },
            "caption": caption,
        }
        for url, caption in items
    ]


def is_url_item(item) -> bool:
    return isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and item[0].startswith(("http://", "https://"))


def raw_text_search(app: SearchApp, gallery: gr.Gallery, batched: bool):
    """The text search for an event listener with ``preprocess=False, postprocess=False``.

    Gradio pre- and post-processes every input and output of every event in a worker
    thread of its own (seven thread hops per text query here). The text search's inputs
    arrive as plain values anyway (a string, m, a bool, k: ``SearchApp`` checks each), so
    this function takes them as they come and returns the gallery already serialised
    (:func:`gallery_wire`, as Gradio would send it).
    """

    def wire(items) -> list:
        return gallery_wire(items) if all(is_url_item(item) for item in items) else gallery.postprocess(items).model_dump()

    if batched:

        def search_texts(query: list, m: list, funnel: list, k: list, request: gr.Request | None = None):
            galleries, statuses, ids = app.search_texts(query, m, funnel, k, request)
            return [wire(g) for g in galleries], statuses, ids

        search_texts.__doc__ = app.search_texts.__doc__
        return search_texts

    def search_text(query: str, m: int, funnel: bool, k: int, request: gr.Request | None = None):
        items, status, ids = app.search_text(query, m, funnel, k, request)
        return wire(items), status, ids

    search_text.__doc__ = app.search_text.__doc__
    return search_text


def set_choices(blocks: gr.Blocks, radio: gr.Radio, choices: list, value) -> None:
    """Give ``radio`` new ``choices`` (and default ``value``) in a launched app: what a newly opened page draws
    (``blocks.config``) and what the API info (``/gradio_api/info``, ``gradio_client.view_api``) lists.

    Gradio builds ``blocks.config`` at launch and caches the API info made from it in its server app
    (``api_info``, ``all_app_info``, ``page_api_info``); a page already open redraws its radio with
    ``gr.update(choices=...)``, but nothing reaches those two. The component's entry is replaced in a
    copy of the config, which is then swapped in whole (requests read it meanwhile), and the caches are
    emptied so the next request makes them again.
    """
    radio.choices = [tuple(c) if isinstance(c, (list, tuple)) else (str(c), c) for c in choices]
    radio.value = value
    config = getattr(blocks, "config", None)
    if not isinstance(config, dict) or not isinstance(config.get("components"), list):
        return  # not launched yet: the config made at launch will have them
    entries = []
    for entry in config["components"]:
        if isinstance(entry, dict) and entry.get("id") == radio._id:
            props = radio.get_config()
            entry = {**entry, "props": {**entry.get("props", {}), "choices": props["choices"], "value": props["value"]}}
            for key in ("api_info", "api_info_as_input"):
                if key in entry:
                    entry[key] = radio.api_info()
        entries.append(entry)
    blocks.config = {**config, "components": entries}
    server = getattr(blocks, "server_app", None)
    if server is not None:
        server.api_info, server.all_app_info, server.page_api_info = None, None, {}


LOCALHOST_PATIENCE = 60.0  # seconds launch waits for its own server's first answer (Gradio's check: one 3 s try)


@contextlib.contextmanager
def patient_localhost_check(seconds: float | None = None):
    """While a ``Blocks.launch`` runs: its check that the new server answers on localhost tries again until
    ``seconds`` (default :data:`LOCALHOST_PATIENCE`) have passed. Gradio gives up after one HEAD request times out (3 s) and raises "When localhost is not
    accessible, a shareable link must be created": on a busy machine (the suite beside a benchmark, an index build
    beside the app) the server's first answer can take longer than that, and the app did not start."""
    from gradio import networking

    once = networking.url_ok
    seconds = LOCALHOST_PATIENCE if seconds is None else seconds

    def patient(url: str) -> bool:
        deadline = time.monotonic() + seconds
        while not once(url):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.5)
        return True

    networking.url_ok = patient
    try:
        yield
    finally:
        networking.url_ok = once
