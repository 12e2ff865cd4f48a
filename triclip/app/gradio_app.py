"""``triclip app``: a Gradio search page over an index folder, assembled from its rooms.

    serve("INDEX", host, port)                           # load, launch, stop on Ctrl-C / SIGTERM
    blocks, app = build_app(Searcher.load("INDEX"), AppConfig("INDEX"))
    launch(blocks, app, HOST, PORT, block=False)         # tests (triclip.app.config: the address by default)

Text -> image, image -> image (upload, or click a result: "more like this", by the
image's stored vector), image -> text when the index holds captions. A radio picks m
among the folder's pruned indexes (with the recall@10 measured at that m); below
full D, the page shows the full-D results beside them and how many they share;
"funnel" shortlists at m and re-ranks at full D. Load measurements: docs/benchmarks.md.

Where each part lives:

- ``triclip.app.live``: the live index (follows ``CURRENT``) and the file guard for result images;
- ``triclip.app.config``: :class:`AppConfig` and the address by default (torch- and Gradio-free);
- ``triclip.app.endpoints``: :class:`SearchApp` and the search endpoints;
- ``triclip.app.json_api``: the JSON route outside Gradio and its batching queue;
- ``triclip.app.panels``: the page's panels, each a function of the live view, and their plots;
- ``triclip.app.gradio_patches``: every override of Gradio internals, pinned to a Gradio version;
- ``triclip.app.server``: launch and stop, threads, the log;
- this module: the page from its panels, the events between them, and :func:`serve`.
"""

from __future__ import annotations

import gc
import signal

import gradio as gr

from triclip.app.config import HOST, PORT, AppConfig, check_address
from triclip.app.endpoints import ENDPOINTS, SearchApp, empty_rows
from triclip.app.gradio_patches import guard_inputs, raw_text_search, set_choices
from triclip.app.panels import Knobs, QueryPanel, ResultsPanel, choices_panel, feature_selection_panel, header, knobs_panel
from triclip.app.panels import live_values, m_choices, query_panel, results_panel
from triclip.app.server import interrupt, launch, log_to_stderr, set_threads, wait

__all__ = ["ENDPOINTS", "AppConfig", "SearchApp", "build_app", "launch", "serve"]
REFRESH_S = 10.0  # an open page asks this often for the live version's name (and redraws only when it changed)


def build_app(searcher, cfg: AppConfig) -> tuple[gr.Blocks, SearchApp]:
    """The page and its API endpoints over a loaded Searcher, and the functions behind them."""
    app = SearchApp(searcher, cfg)
    first = app.live.view()
    with gr.Blocks(title="triclip search", analytics_enabled=False) as blocks:
        title = header(first)
        shown_version = gr.State(first.version)  # the version this page's header, choices and panel show
        ids = gr.State([])  # ids of the gallery's results, in order (for clicks)
        last = gr.State(None)  # the last query: ("text", str) | ("image", path) | ("id", str), re-run when m changes
        captioned = gr.State(None)  # the image whose captions the table shows (path), re-run when m changes
        live_version = gr.State(first.version)  # the live version's name, as the timer last read it
        with gr.Row():
            with gr.Column(scale=3):
                query = query_panel(first)
                results = results_panel()
            with gr.Column(scale=1, min_width=260):
                knobs = knobs_panel(first, cfg.k)
        with gr.Row():
            knobs.explained = choices_panel(first)
        with gr.Row(elem_id="feature-selection"):
            panel = feature_selection_panel(first)
        wire_events(app, cfg, query, results, knobs, ids, (last, captioned))
        drawn = {"version": shown_version, "header": title, "m": knobs.m, "explained": knobs.explained, **panel.by_name()}  # what redraw() names
        refresh = {"fn": lambda version, m: in_order(drawn, redraw(app, version, m)), "inputs": [shown_version, knobs.m],
                   "outputs": list(drawn.values()), "api_visibility": "private", "show_progress": "hidden"}
        # --add / --overwrite swap the version under an open page: the timer reads only its name into a State
        # (nothing drawn is an output of the tick: nothing flashes); the page redraws when the name changed
        gr.Timer(REFRESH_S).tick(lambda: app.live.view().version, None, live_version, api_visibility="private",
                                 show_progress="hidden")
        live_version.change(**refresh)
        blocks.load(**refresh)
    blocks.queue(default_concurrency_limit=cfg.concurrency, max_size=cfg.queue_size)
    app.live.listeners.append(lambda view: set_choices(blocks, knobs.m, m_choices(view), view.dim))  # the API's too
    return guard_inputs(blocks), app


def wire_events(
    app: SearchApp, cfg: AppConfig, q: QueryPanel, r: ResultsPanel, kn: Knobs, ids: gr.State, states: tuple
) -> None:
    """The named API endpoints and the page's events (inside the Blocks): each search, then the full-D comparison;
    ``states``: the last gallery query and the image whose captions are shown, both re-run when a knob changes."""
    last, captioned = states
    knobs = [kn.m, kn.funnel, kn.k]
    shown = [r.gallery, r.status, ids]
    compared = ([last, ids] + knobs, [r.full, r.overlap])
    text_fn = raw_text_search(app, r.gallery, cfg.batch > 1)
    batched = {
        "batch": cfg.batch > 1, "max_batch_size": max(1, cfg.batch), "preprocess": False, "postprocess": False
    }  # the text search takes and gives the wire format: no per-component thread hops in Gradio
    private = {"api_visibility": "private"}
    q.search.click(text_fn, [q.query] + knobs, shown, api_name="search_text", **batched).then(
        lambda text: ("text", text), q.query, last, **private
    ).then(app.compare, *compared, **private)
    q.query.submit(text_fn, [q.query] + knobs, shown, **private, **batched).then(
        lambda text: ("text", text), q.query, last, **private
    ).then(app.compare, *compared, **private)
    q.image_search.click(app.search_image, [q.image] + knobs, shown, api_name="search_image").then(
        lambda p: ("image", p), q.image, last, **private
    ).then(app.compare, *compared, **private)
    q.image.upload(app.search_image, [q.image] + knobs, shown, **private).then(
        lambda p: ("image", p), q.image, last, **private
    ).then(app.compare, *compared, **private)
    captions = [q.captions, q.caption_status]
    q.image_to_text.click(app.image_to_text, [q.image] + knobs, captions, api_name="image_to_text").then(
        lambda p: p, q.image, captioned, **private
    )
    r.clicked.submit(app.more_like_this, [r.clicked] + knobs, shown, api_name="more_like_this")
    r.gallery.select(_clicked_id, ids, r.clicked, **private).then(
        app.more_like_this, [r.clicked] + knobs, shown, **private
    ).then(lambda i: ("id", i), r.clicked, last, **private).then(app.compare, *compared, **private)
    r.gallery.select(lambda i: clicked_query(app, i), r.clicked, q.query, **private)  # the box says what is shown
    # the text box shows the text query the results answer: emptied when another kind of query runs
    for kind in (q.image_search.click, q.image.upload):
        kind(lambda: gr.update(value="", placeholder=QUERY_PLACEHOLDER), None, q.query, **private)
    # a new image: the caption table, its status ("Upload an image first." among them) and what it re-runs are the
    # last image's; emptied until its Captions button is pressed
    q.image.upload(lambda: (empty_rows(), "", None), None, [q.captions, q.caption_status, captioned], **private)

    def recaption(image, m_value, funnel_value, k_value, request: gr.Request):
        """Re-run the caption table (image -> text) when m, the funnel or k change, if it shows any."""
        if not image:
            return gr.skip(), gr.skip()
        return app.image_to_text(image, m_value, funnel_value, k_value, request)

    def rerun(previous, m_value, funnel_value, k_value, request: gr.Request):
        """Re-run the last query when m, the funnel or k change."""
        if not previous:
            return gr.skip(), gr.skip(), gr.skip()
        kind, value = previous
        fn = {"text": app.search_text, "image": app.search_image, "id": app.more_like_this}[kind]
        return fn(value, m_value, funnel_value, k_value, request)

    for knob in (kn.m.change, kn.funnel.change, kn.k.release):
        knob(rerun, [last] + knobs, shown, **private).then(app.compare, *compared, **private)
        knob(recaption, [captioned] + knobs, captions, **private)


QUERY_PLACEHOLDER = "e.g. a red apple"


def clicked_query(app: SearchApp, image_id: str):
    """The text box after a click on a result: empty, saying whose neighbours the gallery shows."""
    from triclip.app.endpoints import image_name

    if not image_id:
        return gr.skip()
    return gr.update(value="", placeholder=f"showing images like {image_name(app.live.view(), image_id)}")


def redraw(app: SearchApp, shown: str | None, m_value) -> dict:
    """Updates of everything drawn from the version, by name (``version``, ``header``, ``m`` and the panel's
    :class:`triclip.app.panels.PanelValues` fields), when the live version is not the one the page shows;
    otherwise none ({}: nothing changes)."""
    view = app.live.view()
    if view.version == shown:
        return {}
    return {"version": view.version, **live_values(view, m_value)}


def in_order(outputs: dict, updates: dict) -> list:
    """``updates`` (by name) as the list Gradio takes for the components ``outputs`` (by name): each output its
    update, those without one left as they are."""
    unknown = set(updates) - set(outputs)
    if unknown:
        raise ValueError(f"updates of components the page does not draw: {sorted(unknown)}")
    return [updates.get(name, gr.skip()) for name in outputs]


def _clicked_id(ids: list[str], evt: gr.SelectData) -> str:
    """The id of the clicked gallery result."""
    return ids[evt.index] if ids and 0 <= evt.index < len(ids) else ""


def serve(
    index: str, host: str = HOST, port: int = PORT, run: str | None = None, device: str | None = None,
    collection: str | None = None,
) -> None:
    """Load the index (a folder, or a Milvus URI: ``triclip.index.milvus_search``) and serve the app until
    Ctrl-C or SIGTERM.

    Raises:
        UserError: a bad address (checked before anything loads), or no usable index.
    """
    from triclip.index.milvus_search import open_searcher

    check_address(host, port)  # one line, before seconds of loading
    cfg = AppConfig(index=index, host=host, port=port, run=run, device=device, collection=collection)
    log_to_stderr()
    set_threads(cfg.threads)  # before the warm-up: the ONNX session takes torch's thread count when it is made
    searcher = open_searcher(index, run=run, device=device, collection=collection)
    searcher.use_text_export()  # text queries through the run's exported text side: less CPU each (a lite run)
    searcher.embed_texts(["warm-up"])  # the first query pays for lazy initialisation (ONNX sessions), not a user
    blocks, app = build_app(searcher, cfg)
    gc.collect()
    gc.freeze()  # the millions of objects loaded so far (torch, transformers, gradio) are never garbage: without
    # this, each full collection walked them all and stalled every request for 0.5-0.8 s under load
    signal.signal(signal.SIGTERM, interrupt)  # `kill` stops it as cleanly as Ctrl-C
    try:
        launch(blocks, app, host, port, block=False)
        where = getattr(searcher, "served_from", index)
        print(f"serving {len(searcher):,} images from {where} at http://{host}:{port}/ (Ctrl-C stops)", flush=True)
        wait(blocks)
    except KeyboardInterrupt:
        blocks.close()
