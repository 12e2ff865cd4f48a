"""``triclip app``: a Gradio search page over an index folder.

    serve("INDEX", host, port)                           # load, launch, stop on Ctrl-C / SIGTERM
    blocks, app = build_app(Searcher.load("INDEX"), AppConfig("INDEX"))
    launch(blocks, app, "127.0.0.1", 7860, block=False)  # tests

Text -> image, image -> image (upload, or click a result: "more like this", by the
image's stored vector), image -> text when the index holds captions. A radio picks m
among the folder's pruned indexes (with the recall@10 measured at that m); below
full D, the page shows the full-D results beside them and how many they share;
"funnel" shortlists at m and re-ranks at full D. The feature-selection panel plots
the importance spectrum (S sorted, its cumulative share, the suggested m) and the
recall-against-m curves the index build stored (run's order, first-m, random, PCA).

Every search is a named API endpoint (``gradio_client``): ``search_text``,
``search_image``, ``more_like_this``, ``image_to_text``; ``m`` and ``k`` may be numbers
or numeric strings. Text -> image is also a plain JSON route outside Gradio
(:class:`JsonSearch`). Bad input gives a message, never a traceback.

The app follows its index (:class:`LiveIndex`): a new version behind ``CURRENT``
(``index build --add``, a rebuild, a rollback) is loaded in the background and swapped
in; each request uses one version from start to end. Result images are served by
``/triclip/image/<row>?v=<version>`` only while the file is the regular file the index
recorded (:class:`ImageFiles`). Private by default: 127.0.0.1, no share link, no
analytics, nothing fetched from outside hosts. Load measurements: docs/benchmarks.md.
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
# auto-detection that lookup cost 1-2% of the server's CPU under load. The app draws its two figures once, at start.
os.environ.setdefault("MPLBACKEND", "agg")

import asyncio  # noqa: E402
import gc  # noqa: E402
import logging  # noqa: E402
import mimetypes  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import stat  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections import OrderedDict  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402
from urllib.parse import urlparse  # noqa: E402

import gradio as gr  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from starlette.responses import PlainTextResponse, Response  # noqa: E402
from starlette.routing import Route  # noqa: E402

from retrieval.errors import UserError  # noqa: E402

log = logging.getLogger("triclip.app")

ENDPOINTS = ("search_text", "search_image", "more_like_this", "image_to_text")
SYSTEM_FONTS = ["ui-sans-serif", "system-ui", "sans-serif"]  # no web fonts: nothing fetched from outside
MONO_FONTS = ["ui-monospace", "SFMono-Regular", "Menlo", "monospace"]
CAPTION_CHARS = 300  # a gallery label shows this much of a caption (wrapped, whole for nearly every caption)
IMAGE_ROUTE = "/triclip/image"  # + "/<row>?v=<version>": an indexed image, served by the app
SEARCH_ROUTE = "/triclip/api/search_text"  # ?q=...&m=...&k=...&funnel=0|1: text -> image as JSON, outside Gradio
SUGGEST_SHARE = 0.9  # the suggested m keeps this share of the total importance
KEPT_VERSIONS = 4  # image tables of this many recent versions answer their own URLs after a swap
CSS = """
#results .grid-container, #full-results .grid-container { grid-auto-rows: auto !important; }
#results button.thumbnail-item, #full-results button.thumbnail-item { height: auto !important; aspect-ratio: auto !important;
  overflow: visible !important; display: flex; flex-direction: column; }
#results button.thumbnail-item img, #full-results button.thumbnail-item img { aspect-ratio: 1 / 1; height: auto !important;
  width: 100% !important; object-fit: contain !important; }
#results .caption-label, #full-results .caption-label { position: static !important; white-space: normal !important;
  overflow: visible !important; text-overflow: clip !important; max-width: 100% !important; width: 100% !important;
  font-size: 0.8em; line-height: 1.25; }
"""  # gallery thumbnails whole (not cropped), captions wrapped instead of cut at one line


@dataclass
class AppConfig:
    """How ``triclip app`` serves an index."""

    index: str  # index folder (triclip index build --out)
    host: str = "127.0.0.1"  # address to bind (127.0.0.1: this machine only)
    port: int = 7860  # port to bind
    run: str | None = None  # run to embed queries with (None: the run recorded in the index)
    device: str | None = None  # torch device (None: cuda when available, else cpu)
    follow: float = 1.0  # seconds between checks of the index's CURRENT for a new version (0: never reload)
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


# ---------------------------------------------------------------------------- what one version serves


@dataclass(frozen=True)
class ImageFiles:
    """The image files of one index version, served only while they are what was indexed.

    A row's file is opened without following a link in its last component (``O_NOFOLLOW``),
    from its folder as resolved when the version was loaded, and served only when the
    opened file is regular and its identity (device, inode, size, mtime_ns) is the one
    the index recorded at build time (meta ``"file"``; for indexes built before that was
    recorded, the identity found when the app loaded the version).
    """

    paths: list[str]  # row -> the path opened (folder resolved at load + file name)
    identity: list[tuple | None]  # row -> (dev, ino, size, mtime_ns); None: never served
    taken_at_load: int = 0  # rows whose identity was taken at load (an index without the build-time record)

    @classmethod
    def of(cls, meta: list[dict]) -> "ImageFiles":
        from index.build import file_identity

        folders: dict[str, str] = {}
        paths, identity, at_load = [], [], 0
        for row in meta:
            path = row.get("image")
            if not isinstance(path, str) or not os.path.isabs(path):
                paths.append("")
                identity.append(None)
                continue
            folder, name = os.path.split(path)
            if folder not in folders:
                folders[folder] = os.path.realpath(folder)
            recorded = row.get("file")
            if "file" not in row:  # built before identities were recorded: take it now
                recorded, at_load = file_identity(path), at_load + 1
            ok = isinstance(recorded, list) and len(recorded) == 4 and all(isinstance(x, int) for x in recorded)
            paths.append(os.path.join(folders[folder], name))
            identity.append(tuple(recorded) if ok else None)
        return cls(paths, identity, at_load)

    def read(self, row: int) -> tuple[bytes | None, str]:
        """``(content, media type)`` of a row's file, or ``(None, why it is refused)``."""
        if not 0 <= row < len(self.paths):
            return None, "no such row"
        path, want = self.paths[row], self.identity[row]
        if want is None:
            return None, "not a regular file when it was indexed"
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as err:  # ELOOP: the last component is a link
            return None, f"cannot open {path} without following links ({err.strerror})"
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return None, f"{path} is not a regular file"
            if (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) != want:
                return None, f"{path} is not the file that was indexed (device, inode, size or mtime changed)"
            chunks, left = [], st.st_size
            while left > 0:
                chunk = os.read(fd, min(left, 1 << 20))
                if not chunk:
                    return None, f"{path} shrank while it was read"
                chunks.append(chunk)
                left -= len(chunk)
        except OSError as err:
            return None, f"cannot read {path} ({err.strerror})"
        finally:
            os.close(fd)
        return b"".join(chunks), mimetypes.guess_type(path)[0] or "application/octet-stream"


@dataclass(frozen=True)
class IndexView:
    """One loaded index version and what the app derives from it; never changed once made."""

    searcher: Any  # index.search.Searcher over this version
    version: str  # its folder name, e.g. "v000003"
    files: ImageFiles  # row -> servable image file
    rows: dict  # id -> row
    recall: dict  # m -> t2i recall@10 measured at m (or None)
    curves: dict | None  # the version's curves.json (index.build._curves), None when it has none

    @classmethod
    def of(cls, searcher, index_dir) -> "IndexView":
        from index.build import read_curves

        manifest, meta = searcher.manifest, searcher.contents.meta
        version = searcher.contents.version or "?"
        files = ImageFiles.of(meta)
        if files.taken_at_load:
            log.warning(
                "index %s %s records no file identities for %d images (built before they were recorded): using the"
                " identity found now (device, inode, size, mtime); rebuild the index to record it at build time",
                index_dir, version, files.taken_at_load,
            )
        recall = {int(m): v for m, v in (manifest.get("recall") or {}).items()}
        return cls(searcher, version, files, {row["id"]: i for i, row in enumerate(meta)}, recall,
                   read_curves(index_dir, searcher.contents.version))

    @property
    def dims(self) -> list[int]:
        return list(self.searcher.dims)

    @property
    def dim(self) -> int:
        return int(self.searcher.dim)


class LiveIndex:
    """The version an app serves, following the index folder's ``CURRENT``.

    :meth:`view` returns the current :class:`IndexView` (a request keeps the one it got
    until it ends); at most every ``interval`` seconds it stats ``CURRENT`` and, when it
    changed, loads the new version in a background thread (the same run: the loaded
    model is reused, :meth:`index.search.Searcher.with_contents`), then swaps the
    reference. Requests keep being answered by the old version meanwhile; it is freed
    when the last request holding it ends.
    """

    def __init__(self, index_dir, view: IndexView, interval: float = 1.0, run=None, device=None):
        self.root = Path(index_dir)
        self.interval = interval  # seconds between checks (0: never)
        self.run, self.device = run, device  # for a version built with another run
        self._view = view
        self._stamp = self._current_stamp()
        self._checked = time.monotonic()
        self._lock = threading.Lock()  # one check / reload at a time
        self._loading = False
        self.files_of: OrderedDict[str, ImageFiles] = OrderedDict([(view.version, view.files)])  # recent versions
        self.swaps = 0  # versions swapped in since start

    def view(self) -> IndexView:
        if self.interval > 0 and time.monotonic() - self._checked >= self.interval and not self._loading:
            with self._lock:
                if time.monotonic() - self._checked >= self.interval and not self._loading:
                    self._checked = time.monotonic()
                    stamp = self._current_stamp()
                    if stamp != self._stamp:
                        self._loading = True
                        threading.Thread(target=self._reload, args=(stamp,), name="triclip-reload", daemon=True).start()
        return self._view

    def _current_stamp(self):
        try:
            st = os.stat(self.root / "CURRENT")
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size  # CURRENT is replaced (a new inode) by every writer

    def reload(self) -> bool:
        """Load the live version now if it is not the one served; True when a new one was swapped in."""
        from index.search import Searcher
        from index.store import load_contents

        old = self._view
        contents = load_contents(self.root)
        if contents.version == old.version:
            return False
        if contents.manifest.get("fingerprint") == old.searcher.manifest.get("fingerprint"):
            searcher = old.searcher.with_contents(contents, self.root)  # the same run: keep the loaded model
        else:
            searcher = Searcher.load(self.root, run=self.run, device=self.device)
        view = IndexView.of(searcher, self.root)
        self.files_of[view.version] = view.files
        while len(self.files_of) > KEPT_VERSIONS:
            self.files_of.popitem(last=False)
        self._view = view  # one reference swap: a request has the old view or the new one, never a mix
        self.swaps += 1
        log.warning(
            "now serving %s version %s: %d images (was %s)", self.root, view.version, len(searcher), old.version
        )
        return True

    def _reload(self, stamp) -> None:
        try:
            self.reload()
        except Exception as err:  # noqa: BLE001 (keep serving the loaded version)
            log.warning("keeping version %s of %s: the new one did not load (%s)", self._view.version, self.root, err)
        finally:
            self._stamp = stamp  # a version that failed is not retried until CURRENT changes again
            self._loading = False


# ---------------------------------------------------------------------------- the endpoints


class SearchApp:
    """The app's search functions over a :class:`LiveIndex`.

    Each public method is one API endpoint; it takes one :class:`IndexView` at its start
    and uses it to the end, returns plain values for the Gradio outputs and turns every
    failure into a status message.
    """

    def __init__(self, searcher, cfg: AppConfig):
        self.cfg = cfg
        self.live = LiveIndex(cfg.index, IndexView.of(searcher, cfg.index), cfg.follow, cfg.run, cfg.device)
        first = self.live.view()
        self.dims: list[int] = first.dims  # what the page's controls offer (ascending, last == D)
        self.dim: int = first.dim
        self.recall = first.recall
        self.has_text: bool = bool(searcher.has_text)
        self.default_base = f"http://{cfg.host}:{cfg.port}"  # image URLs when no request says where we are

    @property
    def searcher(self):
        """The Searcher of the version served now."""
        return self.live.view().searcher

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
        view = self.live.view()
        columns = (query, m, funnel, k)
        if not all(isinstance(x, (list, tuple)) for x in columns) or len({len(x) for x in columns}) != 1:
            n = len(query) if isinstance(query, (list, tuple)) else 1
            out = [self._fail("malformed request: give a query, m, funnel and k")] * n
            return [o[0] for o in out], [o[1] for o in out], [o[2] for o in out]
        queries, ms, funnels, ks = query, m, funnel, k
        cut = self.cfg.max_query_chars
        texts = [(q if isinstance(q, str) else "").strip() for q in queries]
        notes = [f" (query cut to its first {cut:,} characters)" if len(t) > cut else "" for t in texts]
        texts = [t[:cut] for t in texts]
        todo = [i for i, t in enumerate(texts) if t]
        started = time.perf_counter()
        try:
            vectors = view.searcher.embed_texts([texts[i] for i in todo]) if todo else None  # (len(todo), D)
        except Exception:  # let each query fail (or not) on its own, with its own message
            vectors = None
            todo = [i for i in todo if self._embeds(view, texts[i])]
            vectors = view.searcher.embed_texts([texts[i] for i in todo]) if todo else None
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
            search = lambda vector=vector, **kw: view.searcher.search_vectors(vector, **kw)  # noqa: E731
            shown = text if len(text) <= 60 else text[:57] + "..."
            batch = f", embedded in a batch of {len(todo)}" if len(todo) > 1 else ""
            out.append(
                self._gallery(view, search, ms[i], funnels[i], ks[i], request, f"“{shown}”", notes[i] + batch, embed_ms)
            )
        return [o[0] for o in out], [o[1] for o in out], [o[2] for o in out]

    def _embeds(self, view: IndexView, text: str) -> bool:
        try:
            view.searcher.embed_texts([text])
            return True
        except Exception:
            log.exception("embedding a query failed")
            return False

    def search_image(self, image: str | None, m: int, funnel: bool, k: int, request: gr.Request | None = None):
        """Image -> image, for an uploaded image file."""
        view = self.live.view()
        if not image or not isinstance(image, str):
            return self._fail("Upload an image first.")
        search = _explained(image, lambda **kw: view.searcher.search_image([image], **kw))
        return self._gallery(view, search, m, funnel, k, request, "the uploaded image")

    def more_like_this(self, image_id: str, m: int, funnel: bool, k: int, request: gr.Request | None = None):
        """Image -> image for an indexed image, by its id (its stored vector: no re-embedding)."""
        view = self.live.view()
        image_id = image_id.strip() if isinstance(image_id, str) else ""
        if not image_id:
            return self._fail("Click a result first (or give an image id).")
        search = lambda **kw: view.searcher.search_ids([image_id], **kw)  # noqa: E731
        return self._gallery(view, search, m, funnel, k, request, f"image {image_id}")

    def image_to_text(self, image: str | None, m: int, funnel: bool, k: int, request: gr.Request | None = None):
        """Image -> text: the indexed captions nearest to an uploaded image."""
        view = self.live.view()
        if not view.searcher.has_text:
            return _empty_rows(), self._message("This index holds no caption vectors (built without the text index).")
        if not image or not isinstance(image, str):
            return _empty_rows(), self._message("Upload an image first.")
        try:
            search = _explained(image, lambda **kw: view.searcher.search_image([image], target="text", **kw))
            hits, ms, where = self._run(view, search, m, funnel, k)
        except UserError as err:
            return _empty_rows(), self._message(str(err))
        rows = pd.DataFrame(
            [[round(h["score"], 4), h["caption"], h["id"]] for h in hits], columns=["score", "caption", "image id"]
        )
        return rows, f"**{len(hits)} captions** for the uploaded image · {where} · {ms:.1f} ms"

    def compare(self, previous, ids_at_m: list, m, funnel, k, request: gr.Request | None = None):
        """The page's comparison: the last query's results at full D, and how many the results at m share."""
        if not previous or not isinstance(ids_at_m, list) or not ids_at_m:
            return gr.update(value=[], visible=False), ""
        view = self.live.view()
        try:
            m = self._check_m(view, m)
        except UserError:
            return gr.update(value=[], visible=False), ""
        if m == view.dim or _as_bool(funnel):
            note = "the results above are at full D" if m == view.dim else "funnel: the results above are re-ranked at D"
            return gr.update(value=[], visible=False), note
        kind, value = previous
        fn = {"text": self.search_text, "image": self.search_image, "id": self.more_like_this}.get(kind)
        if fn is None:
            return gr.update(value=[], visible=False), ""
        items, _, full_ids = fn(value, view.dim, False, k, request)
        shared = len(set(ids_at_m) & set(full_ids))
        note = f"**{shared} of {len(ids_at_m)} shared** between the results at m = {m} (above)"
        note += f" and at full D = {view.dim} (below)"
        return gr.update(value=items, visible=True), note

    # -- the shared path

    def _gallery(self, view, search, m, funnel, k, request, what: str, note: str = "", extra_ms: float = 0.0):
        try:
            hits, ms, where = self._run(view, search, m, funnel, k)
        except UserError as err:
            return self._fail(str(err))
        ms += extra_ms
        base = self._base(request)
        items = [(self.image_url(base, view, h["id"]), f"{h['score']:.3f} · {_short(h['caption'])}") for h in hits]
        status = f"**{len(hits)} results** for {what} · {where} · {ms:.1f} ms{note}"
        return items, status, [h["id"] for h in hits]

    @staticmethod
    def image_url(base: str, view: IndexView, image_id: str) -> str:
        """The URL of an indexed image: its row in the version that found it."""
        return f"{base}{IMAGE_ROUTE}/{view.rows[image_id]}?v={view.version}"

    def _run(self, view, search, m, funnel, k) -> tuple[list[dict], float, str]:
        """Call ``search(k=, m=, funnel=)``; returns (hits of the one query, milliseconds, a description)."""
        m, k = self._check_m(view, m), self._check_k(k)
        use_funnel = _as_bool(funnel) and m < view.dim
        kwargs = _search_kwargs(view, m, k, use_funnel)
        started = time.perf_counter()
        try:
            hits = search(**kwargs)[0]
        except UserError:
            raise
        except Exception as err:  # a bug, not the user's input: keep serving, log the traceback here
            log.exception("search failed")
            raise UserError(f"search failed: {type(err).__name__}: {err}") from None
        ms = (time.perf_counter() - started) * 1000
        return hits, ms, self._describe(view, m, use_funnel)

    def _base(self, request) -> str:
        """The app's address as the client reached it (so image URLs work from any host it is served to)."""
        try:
            return str(request.base_url).rstrip("/")
        except AttributeError:  # no request: called from Python
            return self.default_base

    def image_response(self, request):
        """``GET IMAGE_ROUTE/<row>[?v=<version>]``: the indexed image of that row, or 404 (and one log line)."""
        return self._serve_row(request.path_params["row"], request.query_params.get("v"))

    def client_image_response(self, request):
        """``GET /gradio_api/file=http.../triclip/image/<row>?v=...``: what gradio_client asks for to fetch
        a gallery result (``download_files=True``, its default: it sends every result's path, here
        our image URL, quoted, to Gradio's file route). Only the index's own images; Gradio's route keeps
        every other ``file=`` path (those never start with ``http``)."""
        match = re.search(re.escape(IMAGE_ROUTE) + r"/(\d+)(?:\?v=(v\d+))?$", request.path_params["rest"])
        if match is None:
            log.warning("file route: refused %s", request.url.path[:200])
            return PlainTextResponse("no such image", status_code=404)
        return self._serve_row(int(match.group(1)), match.group(2) or request.query_params.get("v"))

    def _serve_row(self, row: int, version: str | None):
        files = self.live.files_of.get(version) if version else None
        if files is None:  # no version named, or one no longer kept: the version served now
            files = self.live.view().files
        content, why = files.read(row)
        if content is None:
            log.warning("image route: refused row %s%s: %s", row, f" of {version}" if version else "", why)
            return PlainTextResponse("no such image", status_code=404)
        return Response(content, media_type=why, headers={"Cache-Control": "public, max-age=86400"})

    def _describe(self, view, m: int, funnel: bool) -> str:
        recall = view.recall.get(m)
        measured = f" (recall@10 {recall:.3f})" if recall is not None else ""
        if funnel:
            return f"funnel: shortlist at m = {m}{measured}, re-rank at D = {view.dim}"
        return f"m = {m}{' = D' if m == view.dim else ''}{measured}"

    @staticmethod
    def _check_m(view, m) -> int:
        if m is None or m == "":
            return view.dim
        try:
            m = int(str(m).strip()) if isinstance(m, str) else int(m)
            if isinstance(m, bool):
                raise TypeError
        except (TypeError, ValueError, OverflowError):
            raise UserError(f"m must be one of {view.dims}, got {str(m)[:40]!r}") from None
        if m not in view.dims:
            raise UserError(f"m must be one of {view.dims}, got {m}")
        return m

    @staticmethod
    def _check_k(k) -> int:
        try:
            if isinstance(k, bool) or isinstance(k, (list, dict)):
                raise TypeError
            value = float(str(k).strip()) if isinstance(k, str) else float(k)
            if value != int(value):
                raise ValueError
            k = int(value)
        except (TypeError, ValueError, OverflowError):
            raise UserError(f"k must be a whole number, got {str(k)[:40]!r}") from None
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


def _search_kwargs(view, m: int, k: int, funnel: bool) -> dict:
    """``Searcher.search_*`` arguments for a checked m and k: the full-D index at D, a funnel shortlisting at m."""
    return {"k": k, "m": None if (funnel or m == view.dim) else m, "funnel": m if funnel else None}


def _as_bool(value) -> bool:
    """A checkbox value from the API: a bool, 0/1, or a word such as "true" / "false"."""
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


class JsonSearch:
    """``GET SEARCH_ROUTE?q=...&m=...&k=...&funnel=0|1``: text -> image hits as JSON, outside Gradio.

    For programs (and the load test): the same search as the ``search_text`` endpoint
    without Gradio's queue, session state and event stream, which cost most of the
    server's CPU per query. Queries arriving together are embedded in one batch: one
    drain task at a time takes the waiting queries of one index version (up to
    ``AppConfig.batch``), embeds them in a worker thread and answers each. Answer:
    ``{"query", "m", "funnel", "ms", "hits": [{"id", "image" (URL of the image route),
    "caption", "score"}]}``; bad input is a 400 with ``{"error": message}``.
    """

    def __init__(self, app: SearchApp):
        self.app = app
        self.waiting: list[tuple[IndexView, str, "asyncio.Future"]] = []  # (version, text, its embedding's future)
        self.draining = False  # a drain task is running

    async def respond(self, request):
        """The route's handler: one query's answer."""
        from starlette.responses import JSONResponse

        params = request.query_params
        view = self.app.live.view()  # this query's version, from embedding to hits
        text = (params.get("q") or "").strip()[: self.app.cfg.max_query_chars]
        try:
            if not text:
                raise UserError("empty query: give ?q=...")
            m, k = self.app._check_m(view, params.get("m")), self.app._check_k(params.get("k", self.app.cfg.k))
            funnel = _as_bool(params.get("funnel", "0")) and m < view.dim
            started = time.perf_counter()
            vector = await self._embed(view, text)  # (1, D)
            hits = view.searcher.search_vectors(vector, **_search_kwargs(view, m, k, funnel))[0]
        except UserError as err:
            return JSONResponse({"error": str(err)}, status_code=400)
        base = str(request.base_url).rstrip("/")
        for hit in hits:
            hit["image"] = self.app.image_url(base, view, hit["id"])
        ms = round((time.perf_counter() - started) * 1000, 2)
        return JSONResponse({"query": text, "m": m, "funnel": funnel, "ms": ms, "version": view.version, "hits": hits})

    async def _embed(self, view: IndexView, text: str):
        future = asyncio.get_running_loop().create_future()
        self.waiting.append((view, text, future))
        if not self.draining:
            self.draining = True
            asyncio.get_running_loop().create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        """Embed the waiting queries batch by batch (one version per batch) until none wait."""
        from starlette.concurrency import run_in_threadpool

        try:
            while self.waiting:
                view = self.waiting[0][0]
                same = [w for w in self.waiting if w[0] is view][: self.app.cfg.batch]
                taken = {id(w) for w in same}
                self.waiting = [w for w in self.waiting if id(w) not in taken]
                try:
                    vectors = await run_in_threadpool(view.searcher.embed_texts, [t for _, t, _ in same])  # (B, D)
                except Exception as err:  # noqa: BLE001 (each query is answered, with the error)
                    for _, _, future in same:
                        future.set_exception(err if isinstance(err, UserError) else UserError(f"search failed: {err}"))
                    continue
                for i, (_, _, future) in enumerate(same):
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
        if not isinstance(value, list) or not all(_is_url_item(item) for item in value):
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


# ---------------------------------------------------------------------------- the feature-selection panel


def spectrum_text(importance: list[float], curves: dict | None = None) -> tuple[str, int | None, float]:
    """The words beside the spectrum plot, the suggested m (None when there is nothing to suggest),
    and the power p of S whose cumulative share ``retrieval.compact.suggest_m`` reads (the plot draws it)."""
    w = np.sort(np.asarray(importance, dtype=np.float64))[::-1]  # S, sorted (D,)
    if len(w) == 0:
        return "This index records no importance spectrum.", None, 1.0
    if w[0] - w[-1] <= 1e-6 * max(abs(w[0]), 1e-12):
        return (
            f"**No learned importance**: this run's importance is the same for all {len(w)} dimensions"
            f" (w = {w[0]:.3g}; objectives such as `mrl` and `infonce` learn none), so there is no spectrum to"
            " read and no m to suggest from it. Its order is the embedding's own; the recall chart shows what"
            " each ordering keeps at each m.",
            None,
            1.0,
        )
    half = int(np.searchsorted(np.cumsum(w) / w.sum(), 0.5) + 1)
    words = (
        f"**Importance S** of {len(w)} dimensions, sorted: {w[0]:.3g} down to {w[-1]:.3g}; the top {half} hold"
        " half of its total."
    )
    suggested, power, why = _suggest(w)
    if suggested is None:
        return words + f" No suggested m: {why}.", None, power
    held = "S" if power == 1 else f"S^{power:g}"
    words += (
        f" **Suggested m = {suggested}**: predicted to keep {SUGGEST_SHARE:.0%} of full-D recall (the top"
        f" {suggested} dimensions hold {SUGGEST_SHARE:.0%} of the total {held}; `retrieval.compact.suggest_m`)."
    )
    own = (curves or {}).get("curves", {}).get((curves or {}).get("ordering"), {})
    full = own.get(str(len(w)))
    measured = sorted(int(m) for m, v in own.items() if v is not None and int(m) >= suggested)
    if measured and full:
        at = own[str(measured[0])]
        where = "there" if measured[0] == suggested else f"at m = {measured[0]}, the nearest measured m above it"
        words += f" Measured {where}: recall@10 {at:.3f}, {at / full:.0%} of full D's {full:.3f}."
    return words, suggested, power


def _suggest(w: np.ndarray) -> tuple[int | None, float, str]:
    """``retrieval.compact.suggest_m`` on the spectrum: (m, the power of S it reads, "") or (None, power, why not)."""
    import torch

    from retrieval import compact

    power = compact.SUGGEST_POWER
    suggest_m = compact.suggest_m  # looked up at call time (a test replaces it)
    try:
        m = suggest_m(torch.as_tensor(w.copy(), dtype=torch.float32), share=SUGGEST_SHARE)
    except Exception as err:  # noqa: BLE001 (the panel shows the rest)
        return None, power, f"suggest_m failed ({type(err).__name__}: {err})"
    return int(m), power, ""


def spectrum_figure(importance: list[float], suggested: int | None, power: float = 1.0):
    """S sorted (left axis) and the cumulative share of S^power (right axis) against rank (log 2); None when flat."""
    from matplotlib.figure import Figure

    w = np.sort(np.asarray(importance, dtype=np.float64))[::-1]
    if len(w) == 0 or w[0] - w[-1] <= 1e-6 * max(abs(w[0]), 1e-12):
        return None
    ranks = np.arange(1, len(w) + 1)
    fig = Figure(figsize=(4.6, 2.8), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    ax.plot(ranks, w, color="tab:blue", label="S (sorted)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rank (dimensions kept, m)")
    ax.set_ylabel("importance S", color="tab:blue")
    share = ax.twinx()
    held = "S" if power == 1 else f"S$^{{{power:g}}}$"
    share.plot(ranks, np.cumsum(w**power) / (w**power).sum(), color="tab:orange", label=f"cumulative share of {held}")
    share.set_ylim(0, 1.02)
    share.set_ylabel(f"cumulative share of {held}", color="tab:orange")
    if suggested is not None:
        ax.axvline(suggested, color="tab:green", linestyle="--", label=f"suggested m = {suggested}")
        ax.legend(loc="lower left", fontsize=7)
    ax.set_title("importance spectrum", fontsize=9)
    return fig


ORDERING_LABELS = {"importance": "run's own order", "first": "first-m", "random": "random-m", "pca": "PCA-m"}


def recall_text(curves: dict | None, dims: list[int]) -> str:
    """The words under the recall chart."""
    if not curves:
        return (
            "This index records no recall-against-m curves (built before they were stored, or from embeddings):"
            " rebuild it with `triclip index build ... --val-data VAL` to see them."
        )
    where = "the validation data" if curves.get("split") == "validation" else "the indexed data"
    return (
        f"Text→image recall@10 against m on {where} ({curves.get('queries', '?')} distinct captions,"
        f" {curves.get('images', '?')} images); the index holds m = {', '.join(map(str, dims))}."
    )


def recall_figure(curves: dict | None, dims: list[int]):
    """t2i recall@10 against m for each ordering (log-2 m), the index's m's marked; None without curves."""
    from matplotlib.figure import Figure

    if not curves or not isinstance(curves.get("curves"), dict):
        return None
    fig = Figure(figsize=(4.6, 2.8), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    for name, by_m in curves["curves"].items():
        points = sorted((int(m), v) for m, v in by_m.items() if v is not None)
        if points:
            ax.plot(*zip(*points), marker="o", markersize=3, label=ORDERING_LABELS.get(name, name))
    for m in dims:
        ax.axvline(m, color="0.85", linewidth=0.8, zorder=0)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("m (dimensions kept)")
    ax.set_ylabel("t2i recall@10")
    ax.legend(fontsize=7)
    ax.set_title("recall against m", fontsize=9)
    return fig


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


def build_app(searcher, cfg: AppConfig) -> tuple[gr.Blocks, SearchApp]:
    """The page and its API endpoints over a loaded Searcher, and the functions behind them."""
    app = SearchApp(searcher, cfg)
    first = app.live.view()
    run_name = Path(searcher.manifest.get("run", "")).name or "?"
    importance = list(searcher.manifest.get("importance") or [])
    words, suggested, power = spectrum_text(importance, first.curves)
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
                    label="results at m (click one: more like this)", columns=6, height="auto", allow_preview=False,
                    object_fit="contain", elem_id="results",
                )
                overlap = gr.Markdown("", elem_id="overlap")
                full = result_gallery(
                    label="the same query at full D", columns=6, height="auto", allow_preview=False,
                    object_fit="contain", elem_id="full-results", visible=False,
                )
                clicked = gr.Textbox(visible=False, label="image id", elem_id="clicked-id")  # the clicked result's id
            with gr.Column(scale=1, min_width=260):
                m = loose(gr.Radio(app.m_choices(), value=app.dim, label="m: dimensions searched", elem_id="m"))
                funnel = gr.Checkbox(False, label="funnel: shortlist at m, re-rank at full D", elem_id="funnel")
                k = loose(gr.Slider(1, 100, value=cfg.k, step=1, label="results k", elem_id="k"))
        with gr.Row(elem_id="feature-selection"):
            with gr.Column():
                gr.Markdown(words, elem_id="spectrum")
                spectrum = spectrum_figure(importance, suggested, power)
                if spectrum is not None:
                    gr.Plot(spectrum, show_label=False, elem_id="spectrum-plot")
            with gr.Column():
                gr.Markdown(recall_text(first.curves, first.dims), elem_id="recall-text")
                chart = recall_figure(first.curves, first.dims)
                if chart is not None:
                    gr.Plot(chart, show_label=False, elem_id="recall-chart")

        knobs = [m, funnel, k]
        shown = [gallery, status, ids]
        compared = ([last, ids] + knobs, [full, overlap])
        text_fn = raw_text_search(app, gallery, cfg.batch > 1)
        batched = {
            "batch": cfg.batch > 1, "max_batch_size": max(1, cfg.batch), "preprocess": False, "postprocess": False
        }  # the text search takes and gives the wire format: no per-component thread hops in Gradio
        private = {"api_visibility": "private"}
        search_btn.click(text_fn, [query] + knobs, shown, api_name="search_text", **batched).then(
            lambda q: ("text", q), query, last, **private
        ).then(app.compare, *compared, **private)
        query.submit(text_fn, [query] + knobs, shown, **private, **batched).then(
            lambda q: ("text", q), query, last, **private
        ).then(app.compare, *compared, **private)
        image_btn.click(app.search_image, [image] + knobs, shown, api_name="search_image").then(
            lambda p: ("image", p), image, last, **private
        ).then(app.compare, *compared, **private)
        image.upload(app.search_image, [image] + knobs, shown, **private).then(
            lambda p: ("image", p), image, last, **private
        ).then(app.compare, *compared, **private)
        text_btn.click(app.image_to_text, [image] + knobs, [captions, status], api_name="image_to_text")
        clicked.submit(app.more_like_this, [clicked] + knobs, shown, api_name="more_like_this")
        gallery.select(_clicked_id, ids, clicked, **private).then(
            app.more_like_this, [clicked] + knobs, shown, **private
        ).then(lambda i: ("id", i), clicked, last, **private).then(app.compare, *compared, **private)

        def rerun(previous, m_value, funnel_value, k_value, request: gr.Request):
            """Re-run the last query when m, the funnel or k change."""
            if not previous:
                return gr.skip(), gr.skip(), gr.skip()
            kind, value = previous
            fn = {"text": app.search_text, "image": app.search_image, "id": app.more_like_this}[kind]
            return fn(value, m_value, funnel_value, k_value, request)

        for knob in (m, funnel):
            knob.change(rerun, [last] + knobs, shown, **private).then(app.compare, *compared, **private)
        k.release(rerun, [last] + knobs, shown, **private).then(app.compare, *compared, **private)
    blocks.queue(default_concurrency_limit=cfg.concurrency, max_size=cfg.queue_size)
    return guard_inputs(blocks), app


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


def check_address(host: str, port) -> None:
    """Refuse a port out of range, an unknown host or a port in use, with one line, before anything loads.

    Raises:
        UserError: the address cannot be served.
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise UserError(f"--port must be a whole number from 1 to 65535, got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as err:
        raise UserError(f"cannot serve on {host}:{port}: unknown host ({err})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds: TIME_WAIT is no obstacle
        try:
            probe.bind(address)
        except OSError as err:
            raise UserError(f"cannot serve on {host}:{port}: {err.strerror or err}") from None


def launch(blocks: gr.Blocks, app: SearchApp, host: str, port: int, block: bool = True, sessions: int | None = None):
    """Start the server and return once it answers (``block=True``: then serve until Ctrl-C / SIGTERM).

    Gradio's own start-up lines (its local URL and the "set share=True" hint) are not printed.

    Raises:
        UserError: the address cannot be bound (port out of range or in use, unknown host).
    """
    check_address(host, port)
    image_route = Route(IMAGE_ROUTE + "/{row:int}", app.image_response)  # before Gradio's own routes
    # gradio_client downloads every result file through Gradio's file route, with the result's
    # path, which is our image URL: answer those requests for our own images here as well.
    client_route = Route("/gradio_api/file=http{rest:path}", app.client_image_response)
    search_route = Route(SEARCH_ROUTE, JsonSearch(app).respond, methods=["GET"])
    try:
        result = blocks.launch(
            server_name=host,
            server_port=port,
            share=False,
            inbrowser=False,
            app_kwargs={"routes": [image_route, client_route, search_route]},
            ssr_mode=False,  # no Node server process
            mcp_server=False,
            theme=theme(),
            css=CSS,
            show_error=False,  # our messages go to the status line; no tracebacks in the page
            max_file_size="50mb",
            state_session_capacity=sessions or app.cfg.sessions,
            prevent_thread_lock=True,
            quiet=True,  # no share banner; serve() prints its own line once the port is bound
        )
    except (OSError, OverflowError) as err:
        raise UserError(f"cannot serve on {host}:{port}: {err}") from None
    if block:
        wait(blocks)
    return result


def wait(blocks: gr.Blocks) -> None:
    """Serve until Ctrl-C (or SIGTERM, see :func:`serve`), then close the server."""
    try:
        while blocks.is_running:
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    finally:
        blocks.close()


def serve(
    index: str, host: str = "127.0.0.1", port: int = 7860, run: str | None = None, device: str | None = None
) -> None:
    """Load the index and serve the app until Ctrl-C or SIGTERM.

    Raises:
        UserError: a bad address (checked before anything loads), or no usable index.
    """
    from index.search import Searcher

    check_address(host, port)  # one line, before seconds of loading
    cfg = AppConfig(index=index, host=host, port=port, run=run, device=device)
    _log_to_stderr()
    set_threads(cfg.threads)  # before the warm-up: the ONNX session takes torch's thread count when it is made
    searcher = Searcher.load(index, run=run, device=device)
    searcher.embed_texts(["warm-up"])  # the first query pays for lazy initialisation (ONNX sessions), not a user
    blocks, app = build_app(searcher, cfg)
    gc.collect()
    gc.freeze()  # the millions of objects loaded so far (torch, transformers, gradio) are never garbage: without
    # this, each full collection walked them all and stalled every request for 0.5-0.8 s under load
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops it as cleanly as Ctrl-C
    try:
        launch(blocks, app, host, port, block=False)
        print(f"serving {len(searcher):,} images from {index} at http://{host}:{port}/ (Ctrl-C stops)", flush=True)
        wait(blocks)
    except KeyboardInterrupt:
        blocks.close()


def _log_to_stderr() -> None:
    """The app's own log lines (refused images, version swaps) on stderr, one line each."""
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("triclip app: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def set_threads(threads: int) -> None:
    """Threads each search may use in torch (and the ONNX Runtime sessions made after this) and FAISS."""
    import faiss
    import torch

    torch.set_num_threads(max(1, threads))
    faiss.omp_set_num_threads(max(1, threads))


def _interrupt(signum, frame):
    raise KeyboardInterrupt
