"""The JSON API: ``GET SEARCH_ROUTE?q=...&m=...|bytes=...&k=...&funnel=0|1``, text -> image outside Gradio.

``bytes=B`` searches the codes of B bytes per image (``index build --bytes``) with the stages the build chose
(``funnel=1``: their shortlist re-scored with the float vectors); the answer names ``m`` and ``bytes`` searched
and ``latency_ms``, the budget's single-query latency the build measured at the index's size (at full D the float
scan it held the budgets to; None for an m below D or an index without budgets).

    routes = [json_route(app)]     # app: an triclip.app.endpoints.SearchApp; mounted beside Gradio's routes

For programs (and the load test, ``benchmarks/load_app.py``): the same search as the
``search_text`` endpoint, with its own batching queue (:class:`JsonSearch`).
"""

from __future__ import annotations

import asyncio
import time

from starlette.routing import Route

from triclip.app.endpoints import SearchApp, check_budget, float_latency_ms, search_kwargs
from triclip.app.live import IndexView
from triclip.core.errors import UserError

SEARCH_ROUTE = "/triclip/api/search_text"  # ?q=...&m=...|bytes=...&k=...&funnel=0|1: text -> image as JSON, outside Gradio


def json_route(app: SearchApp) -> Route:
    """The route answering ``GET SEARCH_ROUTE`` for ``app``."""
    return Route(SEARCH_ROUTE, JsonSearch(app).respond, methods=["GET"])


class JsonSearch:
    """``GET SEARCH_ROUTE?q=...&m=...&k=...&funnel=0|1``: text -> image hits as JSON, outside Gradio.

    For programs (and the load test): the same search as the ``search_text`` endpoint
    without Gradio's queue, session state and event stream, which cost most of the
    server's CPU per query. Queries arriving together are embedded in one batch: one
    drain task at a time takes the waiting queries of one index version (up to
    ``AppConfig.batch``), embeds them in a worker thread and answers each. Answer:
    ``{"query", "m", "bytes", "latency_ms", "funnel", "ms", "hits": [{"id", "image" (URL of the image route),
    "caption", "score"}]}`` (with ``bytes``: also ``code`` and ``stored_bytes``); bad input is a 400 with
    ``{"error": message}``.
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
            if params.get("bytes") not in (None, ""):
                if params.get("m") not in (None, ""):
                    raise UserError("give m or bytes, not both")
                m = check_budget(view, params.get("bytes"))  # the codes of that many bytes per image
            else:
                m = self.app._check_m(view, params.get("m"))
            k = self.app._check_k(params.get("k", self.app.cfg.k))
            funnel = self.app._check_funnel(params.get("funnel", "0")) and m != view.dim
            started = time.perf_counter()
            vector = await self._embed(view, text)  # (1, D)
            hits = view.searcher.search_vectors(vector, **search_kwargs(view, m, k, funnel))[0]
        except UserError as err:
            return JSONResponse({"error": str(err)}, status_code=400)
        base = str(request.base_url).rstrip("/")
        hits, left_out = self.app.servable(view, hits)
        for hit in hits:
            hit["image"] = self.app.image_url(base, view, hit["id"])
        ms = round((time.perf_counter() - started) * 1000, 2)
        answer = {"query": text, **_searched(view, m), "funnel": funnel, "ms": ms, "version": view.version,
                  "hits": hits}
        return JSONResponse({**answer, "left_out": left_out} if left_out else answer)

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


def _searched(view: IndexView, m) -> dict:
    """What the answer searched: ``m`` (the code's own m for a budget), ``bytes`` (the budget, or None) and, for
    a budget, ``code`` (its label, codec, m and bytes stored), ``stored_bytes`` (what each image's code holds) and
    ``at_n`` (``triclip.index.report.held_at_n``: its share of exact search's top 10 at the index's N, where its
    inverted lists were tuned there; None elsewhere)."""
    if not isinstance(m, str):  # full D: the float scan the build timed (the budgets' bound); m < D: not timed
        return {"m": m, "bytes": None, "latency_ms": float_latency_ms(view.budgets) if m == view.dim else None}
    from triclip.codecs import CodecSpec
    from triclip.index.report import held_at_n

    entry = view.budgets[int(m[:-1])]
    spec = CodecSpec.from_json(entry["spec"])
    code = {"label": spec.label(), "codec": spec.codec, "m": spec.m, "bytes_per_vector": spec.bytes_per_vector}
    latency = (entry.get("latency") or {}).get("ms")
    return {"m": spec.m, "bytes": int(m[:-1]), "latency_ms": latency, "code": code, "stored_bytes": spec.bytes_per_vector,
            "at_n": held_at_n(entry)}
