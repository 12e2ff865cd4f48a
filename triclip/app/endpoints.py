"""The search endpoints: text -> image, image -> image, more like this, image -> text, over a live index.

    app = SearchApp(searcher, AppConfig("INDEX"))
    gallery, status, ids = app.search_text("a red apple", m=64, funnel=False, k=12)

Each public method of :class:`SearchApp` is one named API endpoint of the page
(``gradio_client``): ``search_text``, ``search_image``, ``more_like_this``,
``image_to_text``; ``m`` and ``k`` may be numbers or numeric strings; ``m`` may also name a
byte budget's codes, e.g. ``"16B"`` (``index build --bytes``; ``image_to_text`` searches that
budget's caption codes), where the funnel re-scores the codes' shortlist with the float vectors. Bad input gives a
message, never a traceback. The indexed images are answered at ``IMAGE_ROUTE``.
"""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path

import gradio as gr
import pandas as pd
from starlette.responses import PlainTextResponse, Response

from triclip.app.config import AppConfig
from triclip.app.live import IndexView, LiveIndex
from triclip.core.errors import UserError

log = logging.getLogger("triclip.app")

ENDPOINTS = ("search_text", "search_image", "more_like_this", "image_to_text")
CAPTION_CHARS = 300  # a gallery label shows this much of a caption (wrapped, whole for nearly every caption)
IMAGE_ROUTE = "/triclip/image"  # + "/<row>?v=<version>": an indexed image, served by the app


class SearchApp:
    """The app's search functions over a :class:`LiveIndex`.

    Each public method is one API endpoint; it takes one :class:`IndexView` at its start
    and uses it to the end, returns plain values for the Gradio outputs and turns every
    failure into a status message.
    """

    def __init__(self, searcher, cfg: AppConfig):
        self.cfg = cfg
        self.live = LiveIndex(cfg.index, IndexView.of(searcher, cfg.index), cfg.follow, cfg.run, cfg.device)
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
        return self._gallery(view, search, m, funnel, k, request, f"images like {image_name(view, image_id)}")

    def image_to_text(self, image: str | None, m: int, funnel: bool, k: int, request: gr.Request | None = None):
        """Image -> text: the indexed captions nearest to an uploaded image."""
        view = self.live.view()
        if not view.searcher.has_text:
            return empty_rows(), self._message("This index holds no caption vectors (built without the text index).")
        if not image or not isinstance(image, str):
            return empty_rows(), self._message("Upload an image first.")
        try:
            search = _explained(image, lambda **kw: view.searcher.search_image([image], target="text", **kw))
            hits, ms, where = self._run(view, search, m, funnel, k, target="text")
        except UserError as err:
            return empty_rows(), self._message(str(err))
        rows = pd.DataFrame([[round(h["score"], 4), h["caption"], h.get("images", 1), h["id"]] for h in hits],
                            columns=CAPTION_COLUMNS)
        return rows, f"**{len(hits)} captions** for the uploaded image · {where} · answered in {ms:.1f} ms"

    def compare(self, previous, ids_at_m: list, m, funnel, k, request: gr.Request | None = None):
        """The page's comparison: the last query's results at full D, and how many the results at m share."""
        if not previous or not isinstance(ids_at_m, list) or not ids_at_m:
            return gr.update(value=[], visible=False), ""
        view = self.live.view()
        try:
            m, funnel = self._check_m(view, m), self._check_funnel(funnel)
        except UserError:
            return gr.update(value=[], visible=False), ""
        if m == view.dim or funnel:
            note = "the results above are at full D" if m == view.dim else "funnel: the results above are re-ranked at D"
            return gr.update(value=[], visible=False), note
        kind, value = previous
        fn = {"text": self.search_text, "image": self.search_image, "id": self.more_like_this}.get(kind)
        if fn is None:
            return gr.update(value=[], visible=False), ""
        items, _, full_ids = fn(value, view.dim, False, k, request)
        shared = len(set(ids_at_m) & set(full_ids))
        at = f"{_budget(m)} B per image" if isinstance(m, str) else f"m = {m}"
        note = f"**{shared} of {len(ids_at_m)} shared** between the results at {at} (above)"
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
        hits, left_out = self.servable(view, hits)
        items = [(self.image_url(base, view, h["id"]), f"{h['score']:.3f} · {_short(h['caption'])}") for h in hits]
        status = f"**{len(hits)} results** for {what} · {where} · answered in {ms:.1f} ms{note}{_left_out(left_out)}"
        return items, status, [h["id"] for h in hits]

    @staticmethod
    def servable(view: IndexView, hits: list[dict]) -> tuple[list[dict], int]:
        """The hits whose image the image route serves now, and how many were left out: a file moved or
        replaced since it was indexed would fail a client that fetches every result (gradio_client's
        default), so its row is dropped from the answer and logged."""
        kept = []
        for hit in hits:
            why = view.files.refused(view.rows[hit["id"]])
            if why is None:
                kept.append(hit)
            else:
                log.warning("left result %s out of the answer: %s", hit["id"], why)
        return kept, len(hits) - len(kept)

    @staticmethod
    def image_url(base: str, view: IndexView, image_id: str) -> str:
        """The URL of an indexed image: its row in the version that found it."""
        return f"{base}{IMAGE_ROUTE}/{view.rows[image_id]}?v={view.version}"

    def _run(self, view, search, m, funnel, k, target: str = "image") -> tuple[list[dict], float, str]:
        """Call ``search(k=, m=, funnel=)`` (or ``bytes=, rescore=``) on the ``target`` vectors; returns (hits of
        the one query, milliseconds, a description)."""
        m, k = self._check_m(view, m), self._check_k(k)
        use_funnel = self._check_funnel(funnel) and m != view.dim
        kwargs = search_kwargs(view, m, k, use_funnel)
        started = time.perf_counter()
        try:
            hits = search(**kwargs)[0]
        except UserError:
            raise
        except Exception as err:  # a bug, not the user's input: keep serving, log the traceback here
            log.exception("search failed")
            raise UserError(f"search failed: {type(err).__name__}: {err}") from None
        ms = (time.perf_counter() - started) * 1000
        return hits, ms, self._describe(view, m, use_funnel, target)

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
        """A row of the version named (404 for one not served: never another version's picture), or
        of the live version when none is named (then not to be cached: the next version may differ)."""
        files = self.live.files_of.get(version) if version else self.live.view().files
        if files is None:
            log.warning("image route: refused row %s of %s: a version not served", row, str(version)[:40])
            return PlainTextResponse("no such version", status_code=404)
        content, why = files.read(row)
        if content is None:
            log.warning("image route: refused row %s%s: %s", row, f" of {version}" if version else "", why)
            return PlainTextResponse("no such image", status_code=404)
        cache = "public, max-age=86400" if version else "no-cache"
        return Response(content, media_type=why, headers={"Cache-Control": cache})

    def _describe(self, view, m: int | str, funnel: bool, target: str = "image") -> str:
        if isinstance(m, str):  # a budget's codes: the image codes, or the caption codes (image -> text)
            entry = view.budgets[_budget(m)]
            entry = entry if target == "image" else entry["text"]
            metric = "recall@10" if target == "image" else "i2t recall@10"
            recall = f" ({metric} {entry['recall']:.3f}{latency_note(entry)})" if entry.get("recall") is not None else ""
            what = f"{_budget(m)} B per {'image' if target == 'image' else 'caption'}: {code_label(entry)}{recall}"
            if funnel:
                return f"{what}, re-scored at D = {view.dim}"
            stage = entry.get("rescore")
            return f"{what}, its top {stage['shortlist']} re-ranked at D = {view.dim}" if stage else what
        recall = view.recall.get(m) if target == "image" else text_recall(view, m)
        metric = "recall@10" if target == "image" else "i2t recall@10"
        measured = f" ({metric} {recall:.3f})" if recall is not None else ""
        if target == "text" and recall is None:
            measured = " (i2t recall@10 not measured here)"
        if funnel:
            return f"funnel: shortlist at m = {m}{measured}, re-rank at D = {view.dim}"
        return f"m = {m}{' = D' if m == view.dim else ''}{measured}"

    @staticmethod
    def _check_m(view, m) -> int | str:
        """A checked choice: an m the index holds (int), or a byte budget with codes as ``"{B}B"``."""
        if m is None or m == "":
            return view.dim
        if isinstance(m, str) and m.strip().upper().endswith("B"):
            return check_budget(view, m.strip()[:-1])
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

    @staticmethod
    def _check_funnel(funnel) -> bool:
        """A checkbox value from the API: a bool, 0 / 1, or true / false, yes / no, on / off (any case);
        anything else is refused like a bad m or k (it was read as false)."""
        if funnel is None or isinstance(funnel, bool):
            return bool(funnel)
        word = str(funnel).strip().lower() if isinstance(funnel, (str, int)) else None
        if word in FUNNEL_WORDS:
            return FUNNEL_WORDS[word]
        raise UserError(f"funnel must be 0 or 1 (or true / false), got {str(funnel)[:40]!r}")

    def _fail(self, message: str):
        return [], self._message(message), []

    @staticmethod
    def _message(message: str) -> str:
        gr.Warning(message)  # a toast in the page; a log line for API clients
        return f"⚠️ {message}"


def search_kwargs(view, m: int | str, k: int, funnel: bool) -> dict:
    """``Searcher.search_*`` arguments for a checked choice and k: the full-D index at D, a funnel shortlisting
    at m; a budget's codes (``"16B"``), their shortlist re-scored with the float vectors under the funnel."""
    if isinstance(m, str):
        return {"k": k, "bytes": _budget(m), "rescore": "float" if funnel else None}
    return {"k": k, "m": None if (funnel or m == view.dim) else m, "funnel": m if funnel else None}


def check_budget(view, value) -> str:
    """A byte budget the index has codes for, as the choice ``"{B}B"``; UserError otherwise."""
    built = sorted(view.budgets)
    try:
        budget = int(str(value).strip())
    except (TypeError, ValueError):
        budget = None
    if budget not in view.budgets:
        raise UserError(f"bytes must be one of {built or 'none (index build --bytes builds some)'}, got {str(value)[:40]!r}")
    return f"{budget}B"


def float_latency_ms(budgets: dict) -> float | None:
    """The full-D float scan's single-query latency, one thread, that ``index build --bytes`` timed and held every
    budget's code to (each budget records it as ``float_latency``); None for an index without byte budgets."""
    timed = [(entry.get("float_latency") or {}).get("ms") for entry in budgets.values()]
    return next((ms for ms in timed if ms is not None), None)


def latency_note(entry: dict) -> str:
    """``", 0.052 ms a query as the build timed it"``: a budget's recorded single-query latency at the index's size (index build --bytes); ""
    for an index that records none. Inverted lists tuned at the index's N add what their answers hold there of
    exact search's top 10 (the recall beside it is measured on the validation gallery)."""
    from triclip.index.report import held_at_n

    latency, at_n = entry.get("latency"), held_at_n(entry)
    held = "" if at_n is None else f"; {at_n['of_exact_top10']:.3f} of exact search's top 10 at N = {at_n['n']:,}"
    return (f", {latency['ms']:.3g} ms a query as the build timed it" if latency else "") + held


def _budget(choice: str) -> int:
    return int(choice[:-1])


def code_label(entry: dict) -> str:
    """The code a budget stores, e.g. ``opq16x8 m=32`` (``triclip.codecs.CodecSpec.label``)."""
    from triclip.codecs import CodecSpec

    return CodecSpec.from_json(entry["spec"]).label()


def text_recall(view, m: int) -> float | None:
    """The image -> text recall@10 measured at m: at full D from the caption codes' frontier (``index build
    --bytes``: its exact-search reference), None where it was not measured (the text indexes' m < D)."""
    front = (view.curves or {}).get("text_bytes") or {}
    return front.get("full_d") if m == view.dim else None


def image_name(view, image_id: str) -> str:
    """An indexed image for people: its first caption in quotes and its file name, e.g. ``“2 dead frogs”
    (frogs_01.png)``; the file name alone without a caption (never the id's whole path)."""
    name = Path(str(image_id)).name
    try:
        meta = view.searcher.contents.meta[view.rows[image_id]]
        caption = " ".join((meta.get("captions") or [""])[0].split())
    except (AttributeError, KeyError, IndexError, TypeError):  # a Milvus collection, an unknown id
        return name
    return f"“{caption if len(caption) <= 60 else caption[:57] + '...'}” ({name})" if caption else name


def _left_out(n: int) -> str:
    """The status's note on results dropped because their file changed since indexing."""
    if not n:
        return ""
    return f" · {n} result{'s' if n > 1 else ''} left out: {'their files' if n > 1 else 'its file'} changed since indexing"


FUNNEL_WORDS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False, "": False}


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


CAPTION_COLUMNS = ["score", "caption", "images with it", "image id"]  # image -> text: one row per distinct caption


def empty_rows() -> pd.DataFrame:
    return pd.DataFrame([], columns=CAPTION_COLUMNS)
