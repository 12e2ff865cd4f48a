"""``triclip app``: a Gradio search page over an index folder.

    blocks, app = build_app(Searcher.load("INDEX"), AppConfig("INDEX"))
    launch(blocks, app, "127.0.0.1", 7860)     # or serve("INDEX", host, port): load, launch, Ctrl-C

Text -> image, image -> image (upload, or click a result: "more like this", which
searches with the stored vector of that image), image -> text when the index holds
captions. A radio picks m among the folder's pruned indexes and shows the recall@10
measured at that m; "funnel" shortlists at m and re-ranks at full D. Changing m or
the funnel re-runs the last query, so results and latency can be compared. A plot
shows the importance spectrum (w in index order).

Every search is a named API endpoint (``gradio_client``): ``search_text``,
``search_image``, ``more_like_this``, ``image_to_text``. For programs, text -> image
is also a plain JSON route outside Gradio, ``GET /triclip/api/search_text?q=...&m=...
&k=...&funnel=0|1`` (:class:`JsonSearch`), a third of the CPU per query. Each returns its results and
a Markdown status line; bad input (empty or huge query, a file that is not an image,
a decompression bomb, an unknown id) gives a message there and a warning toast, never
a traceback, and the app keeps serving.

Private by default: bound to 127.0.0.1, no share link, analytics and version checks
off, system fonts only (nothing is fetched from outside hosts), no server-side
rendering process. Gallery images are served by one route of the app,
``/triclip/image/<row>``, which answers only for the index's own images (by row
number: no file path is ever taken from a request), straight from disk with a cache
header; nothing is copied into Gradio's cache.

Under load (``benchmarks/load_app.py``; profiled with py-spy, 20 clients on 2 cores)
most of the server's CPU is Gradio's HTTP, queue and event-stream machinery, not the
search. What the app does about its own share: text queries waiting together are
embedded in one batch; each search runs on one thread (``AppConfig.threads``); the text
search skips Gradio's per-component pre/post-processing thread hops (:func:`raw_text_search`:
~10-15% less CPU per query) and gallery answers are serialised without Gradio's
per-answer thread pool (:func:`result_gallery`, 0.09 vs 1.5 ms);
the objects loaded at start are frozen out of garbage collection (``gc.freeze``: full
collections had stalled every request for 0.3-0.9 s); at most ``AppConfig.sessions``
Gradio session states are kept. Measured with 20 clients on the demo index (quiet
machine, README "The search app"): 4.3-4.8 ms of server CPU per query through Gradio,
2.55 ms on the JSON route.
"""

from __future__ import annotations

import os
import re

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # read when gradio is imported: no telemetry
# Gradio's queue rebuilds a pandas summary of its last GRADIO_ANALYTICS_MAX_EVENTS (10,000) events after
# every event (for its monitoring page, never sent anywhere): under load that was most of the server's
# event-loop time. Summarise the last 200, every 100 events.
os.environ.setdefault("GRADIO_ANALYTICS_MAX_EVENTS", "200")
os.environ.setdefault("GRADIO_ANALYTICS_CACHE_FREQUENCY", "100")
# Gradio asks matplotlib for its backend around every event (and switches to agg); with the backend left to
# auto-detection that lookup cost 1-2% of the server's CPU under load. The app draws nothing with matplotlib.
os.environ.setdefault("MPLBACKEND", "agg")

import asyncio  # noqa: E402
import gc  # noqa: E402
import logging  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from urllib.parse import urlparse  # noqa: E402

import gradio as gr  # noqa: E402
import pandas as pd  # noqa: E402
from starlette.responses import FileResponse, PlainTextResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402

from retrieval.errors import UserError  # noqa: E402

log = logging.getLogger("triclip.app")

ENDPOINTS = ("search_text", "search_image", "more_like_this", "image_to_text")
SYSTEM_FONTS = ["ui-sans-serif", "system-ui", "sans-serif"]  # no web fonts: nothing fetched from outside
MONO_FONTS = ["ui-monospace", "SFMono-Regular", "Menlo", "monospace"]
CAPTION_CHARS = 90  # a gallery label shows this much of a caption
IMAGE_ROUTE = "/triclip/image"  # + "/<row>": an indexed image, served by the app
SEARCH_ROUTE = "/triclip/api/search_text"  # ?q=...&m=...&k=...&funnel=0|1: text -> image as JSON, outside Gradio


@dataclass
class AppConfig:
    """How ``triclip app`` serves an index."""

    index: str  # index folder (triclip index build --out)
    host: str = "127.0.0.1"  # address to bind (127.0.0.1: this machine only)
    port: int = 7860  # port to bind
    k: int = 12  # results per query by default
    concurrency: int = 2  # searches of one kind running at once; more wait (and batch) in the queue. The
    # model is shared under a lock: 20 clients on 2 cores gave 105-116 queries/s at 2, 82 at 4 (p95 256-302 vs 432-545 ms)
    max_query_chars: int = 1000  # longer text queries are cut here (the text tower reads ~256 tokens anyway)
    queue_size: int = 512  # requests waiting at most; beyond this the queue answers "full"
    batch: int = 16  # text queries waiting together are embedded in one pass, up to this many (1: never)
    sessions: int = 1000  # Gradio session states kept (Gradio's default 10,000): an API call without a session
    # hash makes one per query (~30 block configs), which then weigh on every garbage collection
    threads: int = 1  # torch / ONNX Runtime / FAISS threads per search: the queue already runs `concurrency`
    # searches at once. Alone, a 2-thread text tower took 2.5x the CPU per query of a 1-thread one (batch 16,
    # shared 2 cores); in the app under load the difference was within noise


class SearchApp:
    """The app's search functions over one loaded :class:`index.search.Searcher`.

    Each public method is one API endpoint; it returns plain values for the Gradio
    outputs and turns every failure into a status message.
    """

    def __init__(self, searcher, cfg: AppConfig):
        self.searcher = searcher
        self.cfg = cfg
        self.dims: list[int] = list(searcher.dims)  # ascending, last == D
        self.dim: int = int(searcher.dim)
        manifest = searcher.manifest
        self.recall: dict[int, float | None] = {
            int(m): v for m, v in (manifest.get("recall") or {}).items()
        }  # t2i recall@10 measured at m
        self.importance: list[float] = list(manifest.get("importance") or [])  # w in index order
        self.has_text: bool = bool(searcher.has_text)
        meta = searcher.contents.meta
        self.files: list[str] = [row["image"] for row in meta]  # row -> image file, served by IMAGE_ROUTE
        self.rows: dict[str, int] = {row["id"]: i for i, row in enumerate(meta)}  # id -> row
        self.default_base = f"http://{cfg.host}:{cfg.port}"  # image URLs when no request says where we are

    # -- endpoints: (gallery, status, ids) or (rows, status)

    def search_text(self, query: str, m: int, funnel: bool, k: int, request: gr.Request | None = None):
        """Text -> image."""
        galleries, statuses, ids = self.search_texts([query], [m], [funnel], [k], request)
        return galleries[0], statuses[0], ids[0]

    def search_texts(self, query: list, m: list, funnel: list, k: list, request: gr.Request | None = None):
        """Text -> image for the queries waiting in the queue together (Gradio's ``batch=True``).

        Each argument is a list, one item per query (named as in the single form: the API
        shows these names). One embedding pass for all of them (a batch of 16 short texts
        costs about a quarter of 16 single passes on the CPU), then one index search each.
        Returns one list per output: galleries, statuses, ids.
        """
        queries, ms, funnels, ks = query, m, funnel, k
        cut = self.cfg.max_query_chars
        texts = [(q if isinstance(q, str) else "").strip() for q in queries]
        notes = [f" (query cut to its first {cut:,} characters)" if len(t) > cut else "" for t in texts]
        texts = [t[:cut] for t in texts]
        todo = [i for i, t in enumerate(texts) if t]
        started = time.perf_counter()
        try:
            vectors = self.searcher.embed_texts([texts[i] for i in todo]) if todo else None  # (len(todo), D)
        except Exception:  # let each query fail (or not) on its own, with its own message
            vectors = None
            todo = [i for i in todo if self._embeds(texts[i])]
            vectors = self.searcher.embed_texts([texts[i] for i in todo]) if todo else None
        embed_ms = (time.perf_counter() - started) * 1000
        row_of = {i: j for j, i in enumerate(todo)}
        out = []
        for i, text in enumerate(texts):
            if not text:
                out.append(self._fail("Type a query first: the text is empty."))
                continue
            if i not in row_of:
                out.append(self._fail(f"cannot embed the query “{text[:40]}”"))
                continue
            vector = vectors[row_of[i] : row_of[i] + 1]  # (1, D)
            search = lambda vector=vector, **kw: self.searcher.search_vectors(vector, **kw)  # noqa: E731
            shown = text if len(text) <= 60 else text[:57] + "..."
            batch = f", embedded in a batch of {len(todo)}" if len(todo) > 1 else ""
            out.append(
                self._gallery(search, ms[i], funnels[i], ks[i], request, f"“{shown}”", notes[i] + batch, embed_ms)
            )
        return [o[0] for o in out], [o[1] for o in out], [o[2] for o in out]

    def _embeds(self, text: str) -> bool:
        try:
            self.searcher.embed_texts([text])
            return True
        except Exception:
            log.exception("embedding a query failed")
            return False

    def search_image(self, image: str | None, m: int, funnel: bool, k: int, request: gr.Request | None = None):
        """Image -> image, for an uploaded image file."""
        if not image:
            return self._fail("Upload an image first.")
        search = _explained(image, lambda **kw: self.searcher.search_image([image], **kw))
        return self._gallery(search, m, funnel, k, request, "the uploaded image")

    def more_like_this(self, image_id: str, m: int, funnel: bool, k: int, request: gr.Request | None = None):
        """Image -> image for an indexed image, by its id (its stored vector: no re-embedding)."""
        image_id = (image_id or "").strip()
        if not image_id:
            return self._fail("Click a result first (or give an image id).")
        search = lambda **kw: self.searcher.search_ids([image_id], **kw)  # noqa: E731
        return self._gallery(search, m, funnel, k, request, f"image {image_id}")

    def image_to_text(self, image: str | None, m: int, funnel: bool, k: int, request: gr.Request | None = None):
        """Image -> text: the indexed captions nearest to an uploaded image."""
        if not self.has_text:
            return _empty_rows(), self._message("This index holds no caption vectors (built without the text index).")
        if not image:
            return _empty_rows(), self._message("Upload an image first.")
        try:
            search = _explained(image, lambda **kw: self.searcher.search_image([image], target="text", **kw))
            hits, ms, where = self._run(search, m, funnel, k)
        except UserError as err:
            return _empty_rows(), self._message(str(err))
        rows = pd.DataFrame(
            [[round(h["score"], 4), h["caption"], h["id"]] for h in hits], columns=["score", "caption", "image id"]
        )
        return rows, f"**{len(hits)} captions** for the uploaded image · {where} · {ms:.1f} ms"

    # -- the shared path

    def _gallery(self, search, m, funnel, k, request, what: str, note: str = "", extra_ms: float = 0.0):
        try:
            hits, ms, where = self._run(search, m, funnel, k)
        except UserError as err:
            return self._fail(str(err))
        ms += extra_ms
        base = self._base(request)
        items = [(f"{base}{IMAGE_ROUTE}/{self.rows[h['id']]}", f"{h['score']:.3f} · {_short(h['caption'])}") for h in hits]
        status = f"**{len(hits)} results** for {what} · {where} · {ms:.1f} ms{note}"
        return items, status, [h["id"] for h in hits]

    def _run(self, search, m, funnel, k) -> tuple[list[dict], float, str]:
        """Call ``search(k=, m=, funnel=)``; returns (hits of the one query, milliseconds, a description)."""
        m, k = self._check_m(m), self._check_k(k)
        use_funnel = bool(funnel) and m < self.dim
        kwargs = {"k": k, "m": None if (use_funnel or m == self.dim) else m, "funnel": m if use_funnel else None}
        started = time.perf_counter()
        try:
            hits = search(**kwargs)[0]
        except UserError:
            raise
        except Exception as err:  # a bug, not the user's input: keep serving, log the traceback here
            log.exception("search failed")
            raise UserError(f"search failed: {type(err).__name__}: {err}") from None
        ms = (time.perf_counter() - started) * 1000
        return hits, ms, self._describe(m, use_funnel)

    def _base(self, request) -> str:
        """The app's address as the client reached it (so image URLs work from any host it is served to)."""
        try:
            return str(request.base_url).rstrip("/")
        except AttributeError:  # no request: called from Python
            return self.default_base

    def image_response(self, request):
        """``GET IMAGE_ROUTE/<row>``: the indexed image of that row, or 404."""
        row = request.path_params["row"]
        if not 0 <= row < len(self.files) or not os.path.isfile(self.files[row]):
            return PlainTextResponse("no such image", status_code=404)
        return FileResponse(self.files[row], headers={"Cache-Control": "public, max-age=86400"})

    def client_image_response(self, request):
        """``GET /gradio_api/file=http.../triclip/image/<row>``: what gradio_client asks for to fetch
        a gallery result (``download_files=True``, its default: it sends every result's path, here
        our image URL, to Gradio's file route). Only the index's own images; Gradio's route keeps
        every other ``file=`` path (those never start with ``http``)."""
        match = re.search(re.escape(IMAGE_ROUTE) + r"/(\d+)$", request.path_params["rest"])
        if match is None:
            return PlainTextResponse("no such image", status_code=404)
        request.path_params["row"] = int(match.group(1))
        return self.image_response(request)

    def _describe(self, m: int, funnel: bool) -> str:
        recall = self.recall.get(m)
        measured = f" (recall@10 {recall:.3f})" if recall is not None else ""
        if funnel:
            return f"funnel: shortlist at m = {m}{measured}, re-rank at D = {self.dim}"
        return f"m = {m}{' = D' if m == self.dim else ''}{measured}"

    def _check_m(self, m) -> int:
        if m is None or m == "":
            return self.dim
        try:
            m = int(m)
        except (TypeError, ValueError):
            raise UserError(f"m must be one of {self.dims}, got {m!r}") from None
        if m not in self.dims:
            raise UserError(f"m must be one of {self.dims}, got {m}")
        return m

    @staticmethod
    def _check_k(k) -> int:
        try:
            k = int(k)
        except (TypeError, ValueError):
            raise UserError(f"k must be a whole number, got {k!r}") from None
        if not 1 <= k <= 100:
            raise UserError(f"k must be between 1 and 100, got {k}")
        return k

    def _fail(self, message: str):
        return [], self._message(message), []

    @staticmethod
    def _message(message: str) -> str:
        gr.Warning(message)  # a toast in the page; a log line for API clients
        return f"⚠️ {message}"

    # -- what the page shows besides results

    def m_choices(self) -> list[tuple[str, int]]:
        """Radio choices: (label with the measured recall, m)."""
        out = []
        for m in self.dims:
            label = f"{m} = D" if m == self.dim else str(m)
            if self.recall.get(m) is not None:
                label += f" · R@10 {self.recall[m]:.3f}"
            out.append((label, m))
        return out

    def spectrum(self) -> pd.DataFrame:
        """The importance w against its rank (index order), for the plot."""
        return pd.DataFrame({"dimension (index order)": range(len(self.importance)), "importance w": self.importance})


class JsonSearch:
    """``GET SEARCH_ROUTE?q=...&m=...&k=...&funnel=0|1``: text -> image hits as JSON, outside Gradio.

    For programs (and the load test): the same search as the ``search_text`` endpoint
    without Gradio's queue, session state and event stream, which cost most of the
    server's CPU per query. Queries arriving together are embedded in one batch: one
    drain task at a time takes every waiting query (up to ``AppConfig.batch``), embeds
    them in a worker thread and answers each. Answer: ``{"query", "m", "funnel", "ms",
    "hits": [{"id", "image" (URL of the image route), "caption", "score"}]}``; bad input
    is a 400 with ``{"error": message}``.
    """

    def __init__(self, app: SearchApp):
        self.app = app
        self.waiting: list[tuple[str, "asyncio.Future"]] = []  # (text, its embedding's future)
        self.draining = False  # a drain task is running

    async def respond(self, request):
        """The route's handler: one query's answer."""
        from starlette.responses import JSONResponse

        params = request.query_params
        text = (params.get("q") or "").strip()[: self.app.cfg.max_query_chars]
        try:
            if not text:
                raise UserError("empty query: give ?q=...")
            m, k = self.app._check_m(params.get("m")), self.app._check_k(params.get("k", self.app.cfg.k))
            funnel = params.get("funnel", "0").lower() in ("1", "true", "yes") and m < self.app.dim
            started = time.perf_counter()
            vector = await self._embed(text)  # (1, D)
            kwargs = {"k": k, "m": None if (funnel or m == self.app.dim) else m, "funnel": m if funnel else None}
            hits = self.app.searcher.search_vectors(vector, **kwargs)[0]
        except UserError as err:
            return JSONResponse({"error": str(err)}, status_code=400)
        base = str(request.base_url).rstrip("/")
        for hit in hits:
            hit["image"] = f"{base}{IMAGE_ROUTE}/{self.app.rows[hit['id']]}"
        ms = round((time.perf_counter() - started) * 1000, 2)
        return JSONResponse({"query": text, "m": m, "funnel": funnel, "ms": ms, "hits": hits})

    async def _embed(self, text: str):
        future = asyncio.get_running_loop().create_future()
        self.waiting.append((text, future))
        if not self.draining:
            self.draining = True
            asyncio.get_running_loop().create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        """Embed the waiting queries batch by batch until none wait."""
        from starlette.concurrency import run_in_threadpool

        try:
            while self.waiting:
                batch, self.waiting = self.waiting[: self.app.cfg.batch], self.waiting[self.app.cfg.batch :]
                try:
                    vectors = await run_in_threadpool(self.app.searcher.embed_texts, [t for t, _ in batch])  # (B, D)
                except Exception as err:  # noqa: BLE001 (each query is answered, with the error)
                    for _, future in batch:
                        future.set_exception(err if isinstance(err, UserError) else UserError(f"search failed: {err}"))
                    continue
                for i, (_, future) in enumerate(batch):
                    future.set_result(vectors[i : i + 1])
        finally:
            self.draining = False


BAD_IMAGE = {  # the data layer's reasons, for people
    "corrupt_image": "is not an image that can be read (or it is damaged)",
    "decompression_bomb": "has too many pixels to decode safely (decompression-bomb guard)",
    "missing_file": "did not arrive (upload it again)",
}


def _explained(path: str, search):
    """``search`` with an unreadable upload's message naming the file, not Gradio's cache path."""

    def wrapped(**kw):
        try:
            return search(**kw)
        except UserError as err:
            text = str(err)
            for reason, meaning in BAD_IMAGE.items():
                if reason in text:
                    raise UserError(f"The uploaded file {Path(path).name} {meaning}.") from None
            raise UserError(text.replace(str(path), Path(path).name)) from None

    return wrapped


def _short(caption: str) -> str:
    caption = " ".join((caption or "").split())
    return caption if len(caption) <= CAPTION_CHARS else caption[: CAPTION_CHARS - 1] + "…"


def _empty_rows() -> pd.DataFrame:
    return pd.DataFrame([], columns=["score", "caption", "image id"])


def query_image(**kwargs) -> gr.Image:
    """A ``gr.Image`` input that hands the uploaded file's path to the app without decoding it.

    ``gr.Image`` opens every upload with Pillow before the app sees it, so a file that is
    not an image, or a decompression bomb, fails inside Gradio with a generic error. This
    one passes the path straight to the Searcher, whose guarded decode turns it into a
    message. Gradio has already checked that the path lies in its upload folder. (An
    instance override: subclassing a component makes Gradio write a .pyi beside this file.)
    """
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
        return str(payload.path)

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
        if not isinstance(value, list) or not all(_is_url_item(item) for item in value):
            return postprocess(value)
        return GalleryData.model_validate(gallery_wire(value))  # one serialisation: gallery_wire's

    gallery.postprocess = urls_only
    return gallery


def build_app(searcher, cfg: AppConfig) -> tuple[gr.Blocks, SearchApp]:
    """The page and its API endpoints over a loaded Searcher, and the functions behind them."""
    app = SearchApp(searcher, cfg)
    run_name = Path(searcher.manifest.get("run", "")).name or "?"
    with gr.Blocks(title="triclip search", analytics_enabled=False) as blocks:
        gr.Markdown(
            f"## triclip search · {len(searcher):,} images · D = {app.dim} · run `{run_name}`\n"
            "Search by text or by image; click a result for more like it. "
            "Pick m to search a pruned index (its measured text→image recall@10 is shown)."
        )
        ids = gr.State([])  # ids of the gallery's results, in order (for clicks)
        last = gr.State(None)  # the last query: ("text", str) | ("image", path) | ("id", str), re-run when m changes
        with gr.Row():
            with gr.Column(scale=3):
                with gr.Tab("Text → image"):
                    with gr.Row():
                        query = gr.Textbox(
                            label="query", placeholder="e.g. a red apple", scale=5, max_lines=2, elem_id="query"
                        )
                        search_btn = gr.Button("Search", variant="primary", scale=1, elem_id="search")
                with gr.Tab("Image → image / text"):
                    with gr.Row():
                        image = query_image(
                            label="query image", sources=["upload", "clipboard"], height=180, elem_id="query-image"
                        )
                        with gr.Column():
                            image_btn = gr.Button("Similar images", variant="primary", elem_id="image-search")
                            text_btn = gr.Button("Captions (image → text)", visible=app.has_text, elem_id="image-to-text")
                    captions = gr.Dataframe(
                        value=_empty_rows(), label="nearest captions", visible=app.has_text, interactive=False,
                        elem_id="captions",
                    )
                status = gr.Markdown("Results appear below.", elem_id="status")
                gallery = result_gallery(
                    label="results (click one: more like this)", columns=6, height="auto", allow_preview=False,
                    object_fit="contain", elem_id="results",
                )
                clicked = gr.Textbox(label="more like this: image id", elem_id="clicked-id", max_lines=1)
            with gr.Column(scale=1, min_width=260):
                m = gr.Radio(app.m_choices(), value=app.dim, label="m: dimensions searched", elem_id="m")
                funnel = gr.Checkbox(False, label="funnel: shortlist at m, re-rank at full D", elem_id="funnel")
                k = gr.Slider(1, 100, value=cfg.k, step=1, label="results k", elem_id="k")
                gr.LinePlot(
                    app.spectrum(), x="dimension (index order)", y="importance w", label="importance spectrum",
                    height=220, elem_id="spectrum",
                )

        knobs = [m, funnel, k]
        shown = [gallery, status, ids]
        text_fn = raw_text_search(app, gallery, cfg.batch > 1)
        batched = {
            "batch": cfg.batch > 1, "max_batch_size": max(1, cfg.batch), "preprocess": False, "postprocess": False
        }  # the text search takes and gives the wire format: no per-component thread hops in Gradio
        search_btn.click(text_fn, [query] + knobs, shown, api_name="search_text", **batched).then(
            lambda q: ("text", q), query, last, api_visibility="private"
        )
        query.submit(text_fn, [query] + knobs, shown, api_visibility="private", **batched).then(
            lambda q: ("text", q), query, last, api_visibility="private"
        )
        image_btn.click(app.search_image, [image] + knobs, shown, api_name="search_image").then(
            lambda p: ("image", p), image, last, api_visibility="private"
        )
        image.upload(app.search_image, [image] + knobs, shown, api_visibility="private").then(
            lambda p: ("image", p), image, last, api_visibility="private"
        )
        text_btn.click(app.image_to_text, [image] + knobs, [captions, status], api_name="image_to_text")
        clicked.submit(app.more_like_this, [clicked] + knobs, shown, api_name="more_like_this").then(
            lambda i: ("id", i), clicked, last, api_visibility="private"
        )
        gallery.select(_clicked_id, ids, clicked, api_visibility="private").then(
            app.more_like_this, [clicked] + knobs, shown, api_visibility="private"
        ).then(lambda i: ("id", i), clicked, last, api_visibility="private")

        def rerun(previous, m_value, funnel_value, k_value, request: gr.Request):
            """Re-run the last query when m, the funnel or k change."""
            if not previous:
                return gr.skip(), gr.skip(), gr.skip()
            kind, value = previous
            fn = {"text": app.search_text, "image": app.search_image, "id": app.more_like_this}[kind]
            return fn(value, m_value, funnel_value, k_value, request)

        for knob in (m, funnel):
            knob.change(rerun, [last] + knobs, shown, api_visibility="private")
        k.release(rerun, [last] + knobs, shown, api_visibility="private")
    blocks.queue(default_concurrency_limit=cfg.concurrency, max_size=cfg.queue_size)
    return blocks, app


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


def _is_url_item(item) -> bool:
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
        return gallery_wire(items) if all(_is_url_item(item) for item in items) else gallery.postprocess(items).model_dump()

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


def _clicked_id(ids: list[str], evt: gr.SelectData) -> str:
    """The id of the clicked gallery result."""
    return ids[evt.index] if ids and 0 <= evt.index < len(ids) else ""


def theme() -> gr.themes.Base:
    """Gradio's default look with system fonts (the default theme loads Google fonts)."""
    return gr.themes.Default(font=SYSTEM_FONTS, font_mono=MONO_FONTS)


def launch(blocks: gr.Blocks, app: SearchApp, host: str, port: int, block: bool = True, sessions: int | None = None):
    """Start the server (``block=False``: return once it answers, for tests).

    Raises:
        UserError: the address cannot be bound (port in use, unknown host).
    """
    image_route = Route(IMAGE_ROUTE + "/{row:int}", app.image_response)  # before Gradio's own routes
    # gradio_client downloads every result file through Gradio's file route, with the result's
    # path, which is our image URL: answer those requests for our own images here as well.
    client_route = Route("/gradio_api/file=http{rest:path}", app.client_image_response)
    search_route = Route(SEARCH_ROUTE, JsonSearch(app).respond, methods=["GET"])
    try:
        return blocks.launch(
            server_name=host,
            server_port=port,
            share=False,
            inbrowser=False,
            app_kwargs={"routes": [image_route, client_route, search_route]},
            ssr_mode=False,  # no Node server process
            mcp_server=False,
            theme=theme(),
            show_error=False,  # our messages go to the status line; no tracebacks in the page
            max_file_size="50mb",
            state_session_capacity=sessions or app.cfg.sessions,
            prevent_thread_lock=not block,
            quiet=not block,
        )
    except OSError as err:
        raise UserError(f"cannot serve on {host}:{port}: {err}") from None


def serve(index: str, host: str = "127.0.0.1", port: int = 7860, run: str | None = None, device: str | None = None):
    """Load the index and serve the app until Ctrl-C."""
    from index.search import Searcher

    cfg = AppConfig(index=index, host=host, port=port)
    set_threads(cfg.threads)  # before the warm-up: the ONNX session takes torch's thread count when it is made
    searcher = Searcher.load(index, run=run, device=device)
    searcher.embed_texts(["warm-up"])  # the first query pays for lazy initialisation (ONNX sessions), not a user
    blocks, app = build_app(searcher, cfg)
    gc.collect()
    gc.freeze()  # the millions of objects loaded so far (torch, transformers, gradio) are never garbage: without
    # this, each full collection walked them all and stalled every request for 0.5-0.8 s under load
    print(f"serving {len(searcher):,} images from {index} at http://{host}:{port}/ (Ctrl-C stops)", flush=True)
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops it as cleanly as Ctrl-C
    try:
        launch(blocks, app, host, port, block=True)
    except KeyboardInterrupt:
        pass
    finally:
        blocks.close()


def set_threads(threads: int) -> None:
    """Threads each search may use in torch (and the ONNX Runtime sessions made after this) and FAISS."""
    import faiss
    import torch

    torch.set_num_threads(max(1, threads))
    faiss.omp_set_num_threads(max(1, threads))


def _interrupt(signum, frame):
    raise KeyboardInterrupt
