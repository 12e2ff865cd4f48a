"""Load test of a running ``triclip app``: concurrent text searches through its HTTP API.

Usage::

    triclip app --index demo/index --port 7860 &
    .venv/bin/python -m benchmarks.load_app --url http://127.0.0.1:7860/ --clients 20 --seconds 30 \
        --queries-from demo/data/val.jsonl --server-pid $(pgrep -f "triclip app")

Each of ``--clients`` clients sends one search after another (a closed loop: the next
query leaves when the last answer came back) through Gradio's plain HTTP API:
``POST gradio_api/call/search_text`` queues the query and returns an event id,
``GET gradio_api/call/search_text/<id>`` streams the answer. The latency of a query is
the time from the POST to the answer, so it includes Gradio's queue. ``--api run`` posts
to ``gradio_api/run/search_text`` and gets the answer in the reply, outside the queue;
the app's ``search_text`` is a batched event (``batch=True``), and Gradio (6.31) answers
a single sample sent there with HTTP 500 (it wraps the sample as one input column), so
the query goes as a batch of one (``"batched": true``, one list per input) and the answer
comes back as one list per output; an app started with ``--batch 1`` (not batched) gets
a plain sample (read from the app's ``/config``). ``--api json``
sends the same searches to the app's JSON route instead (``GET
/triclip/api/search_text?q=...``, outside Gradio: one request, no queue, no session).

The clients share the machine with the app, so they are made light: by default
(``--client async``) they are coroutines of one event loop, each on its own raw HTTP/1.1
keep-alive connection (~0.3 ms of CPU per query, against ~2 ms for ``--client threads``,
an ``httpx`` client per thread; ``--client gradio`` runs a ``gradio_client.Client`` per
thread, what a Python user would). ``--server-pid`` reports the app's CPU time per
query, which a loaded machine distorts far less than latency.

Queries: ``--queries-from`` a manifest takes the first caption of each record (for
openclipart, the titles people gave their images: 344 distinct ones in ``val.jsonl``),
or a file, one per line; by default 2,400 made-up ones (colours x things x places).
Each distinct text is sent in a shuffled order and the list repeats; the app keeps no
query cache, so a repeat costs as much as a first time.

Bounded: at most ``--seconds`` of sending and ``--max-requests`` queries in all, and
only to 127.0.0.1 / localhost (the command refuses any other host). Prints the
number of queries, throughput, p50 / p95 / p99 latency, the app's own search time
(embedding + FAISS, from the status line), CPU per query and errors by kind;
``--json`` prints one JSON object instead.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import re
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Iterable
from urllib.parse import urlencode, urlparse

import httpx
import numpy as np

LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}
COLOURS = ["red", "blue", "green", "yellow", "black", "white", "orange", "purple", "pink", "brown", "grey", "golden"]
THINGS = [
    "apple", "cat", "dog", "house", "tree", "car", "flower", "bird", "star", "heart", "fish", "boat", "sun",
    "guitar", "book", "clock", "hat", "shoe", "flag", "key",
]  # fmt: skip
PLACES = ["", " on a white background", " in a circle", " icon", " cartoon", " drawing", " with a shadow", " sign",
          " and a moon", " outline"]  # fmt: skip
JSON_ROUTE = "/triclip/api/search_text"  # triclip.app.json_api.SEARCH_ROUTE (not imported: this runs without the app's packages)
STATUS_MS = re.compile(r"· answered in ([0-9.]+) ms")  # the app's search time in its status line


@dataclass
class LoadConfig:
    """What to send, how much and for how long."""

    url: str  # the app, e.g. http://127.0.0.1:7860/
    clients: int = 20  # concurrent clients, each sending one query after another
    seconds: float = 30.0  # sending stops after this long
    max_requests: int = 100_000  # and after this many queries in all
    m: int | str | None = None  # the m searched, or a byte budget's codes as "8B" (None: the app's default, D)
    funnel: bool = False  # funnel search: shortlist at m, re-rank at D
    k: int = 12  # results per query
    timeout: float = 30.0  # seconds one query may take before it counts as an error
    seed: int = 0  # order of the queries
    queries_from: str | None = None  # a manifest (.jsonl: first captions) or a file of queries; None: made-up ones
    api: str = "call"  # call: through the app's queue, like the page and gradio_client; run: direct POST; json:
    # the app's JSON route (outside Gradio)
    server_pid: int | None = None  # the app's process id (this machine): report its CPU time per query
    client: str = "async"  # async: coroutines on raw HTTP (light); threads: httpx per thread; gradio: gradio_client
    run_batched: bool | None = None  # --api run: whether the app's search_text is batched (None: read its /config)


@dataclass
class Tally:
    """What the clients saw (shared, under a lock)."""

    latencies: list[float] = field(default_factory=list)  # seconds per successful query
    server_ms: list[float] = field(default_factory=list)  # the app's own search time per query
    errors: Counter = field(default_factory=Counter)  # kind -> count
    sent: int = 0  # queries started
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, budget: int) -> bool:
        """Count one more query started; False once ``budget`` queries were started."""
        with self.lock:
            if self.sent >= budget:
                return False
            self.sent += 1
            return True

    def failed(self, err: BaseException) -> None:
        with self.lock:
            self.errors[f"{type(err).__name__}: {str(err)[:60]}"] += 1

    def answered(self, seconds: float, server_ms: float | None) -> None:
        with self.lock:
            self.latencies.append(seconds)
            if server_ms is not None:
                self.server_ms.append(server_ms)


def client_texts(cfg: LoadConfig, texts: list[str], offset: int, deadline: float, tally: Tally):
    """The queries of client ``offset`` (every ``cfg.clients``-th text), until the deadline or the budget."""
    i = offset
    while time.perf_counter() < deadline and tally.take(cfg.max_requests):
        yield texts[i % len(texts)]
        i += cfg.clients


def queries(seed: int, source: str | None = None) -> list[str]:
    """Distinct text queries in a shuffled order.

    ``source``: None for 2,400 made-up ones (colours x things x places); a ``.jsonl``
    manifest for the first caption of each record (openclipart: the titles people
    gave their images, e.g. ``demo/data/val.jsonl``); any other file for its lines.
    """
    if source is None:
        texts = [f"a {c} {t}{p}" for c, t, p in itertools.product(COLOURS, THINGS, PLACES)]
    else:
        try:
            with open(source, encoding="utf-8") as fh:
                lines = [line.strip() for line in fh if line.strip()]
        except OSError as err:
            raise SystemExit(f"load_app: cannot read queries from {source}: {err.strerror}") from None
        if source.endswith(".jsonl"):
            lines = [str((json.loads(line).get("captions") or [""])[0]).strip() for line in lines]
        texts = list(dict.fromkeys(t[:1000] for t in lines if t))  # distinct, first seen order
        if not texts:
            raise SystemExit(f"load_app: no queries in {source}")
    random.Random(seed).shuffle(texts)
    return texts


def check_local(url: str) -> str:
    """The URL with a trailing slash; refuses anything but this machine."""
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or parsed.hostname not in LOCAL_HOSTS:
        raise SystemExit(f"load_app: only sends to 127.0.0.1 / localhost, got {url!r}")
    return url if url.endswith("/") else url + "/"


def default_m(url: str) -> int:
    """The app's default m (its radio's value), read from its API description."""
    info = httpx.get(url + "gradio_api/info", timeout=30).json()
    for param in info["named_endpoints"]["/search_text"]["parameters"]:
        if param.get("parameter_name") == "m":
            return int(param["parameter_default"])
    raise SystemExit("load_app: the app's search_text endpoint has no parameter m")


def text_batched(url: str) -> bool:
    """Whether the app's ``search_text`` event is batched (``batch=True``), from its ``/config``."""
    config = httpx.get(url + "config", timeout=30).json()
    for dep in config.get("dependencies", []):
        if dep.get("api_name") == "search_text":
            return bool(dep.get("batch"))
    raise SystemExit("load_app: the app has no search_text endpoint")


def call_body(text: str, m: int, cfg: LoadConfig, session: str | None) -> dict:
    """The body of ``POST gradio_api/call/search_text``: one sample, the inputs in order."""
    return {"data": [text, m, cfg.funnel, cfg.k], "session_hash": session}


def run_body(text: str, m: int, cfg: LoadConfig, session: str | None) -> dict:
    """The body of ``POST gradio_api/run/search_text``: a batch of one for a batched event, else the sample."""
    body = call_body(text, m, cfg, session)
    if cfg.run_batched:  # Gradio's own batch layout: one list per input, "batched" set
        body.update(data=[[value] for value in body["data"]], batched=True)
    return body


def run_outputs(answer: dict, cfg: LoadConfig) -> list:
    """The outputs of one query from a ``gradio_api/run`` reply (a batch answers one list per output)."""
    data = answer["data"]
    return [column[0] for column in data] if cfg.run_batched else data


def one_query(client: httpx.Client, url: str, text: str, cfg: LoadConfig, m: int, session: str | None = None) -> float | None:
    """Send one search and wait for its answer; returns the app's search ms (None if absent).

    Raises:
        RuntimeError: the app answered with an error event (its message).
    """
    if cfg.api == "json":  # the app's JSON route, outside Gradio
        answer = client.get(url + JSON_ROUTE.lstrip("/"), params=json_params(text, m, cfg))
        answer.raise_for_status()
        return _read_json(answer.json())
    if cfg.api == "run":  # one request, answered directly (outside the queue)
        answer = client.post(url + "gradio_api/run/search_text", json=run_body(text, m, cfg, session))
        answer.raise_for_status()
        return _read_answer(run_outputs(answer.json(), cfg))
    start = client.post(url + "gradio_api/call/search_text", json=call_body(text, m, cfg, session))
    start.raise_for_status()
    event_id = start.json()["event_id"]
    with client.stream("GET", url + f"gradio_api/call/search_text/{event_id}") as stream:
        stream.raise_for_status()
        return _read_events(stream.iter_lines())  # stops reading at the answer


def json_params(text: str, m: int, cfg: LoadConfig) -> dict:
    """Query parameters of the JSON route."""
    return {"q": text, "m": m, "k": cfg.k, "funnel": int(cfg.funnel)}


def _read_json(answer: dict) -> float:
    """The app's search ms from a JSON route answer."""
    if not answer.get("hits"):
        raise RuntimeError(f"no results: {str(answer)[:80]}")
    return float(answer["ms"])


def _read_answer(outputs: list) -> float | None:
    """The app's search ms from an answer's outputs (gallery, status, ids kept for clicks)."""
    gallery, status = outputs[:2]
    if not gallery:
        raise RuntimeError(f"no results: {status[:80]}")
    found = STATUS_MS.search(status)
    return float(found.group(1)) if found else None


def session_of(client: int) -> str:
    """The Gradio session of client number ``client``: one per client, as a browser tab or a
    ``gradio_client.Client`` has (without one, Gradio makes a session, ~30 block configs, per query)."""
    return f"load-{os.getpid()}-{client}"


def client_loop(cfg: LoadConfig, url: str, m: int, texts: list[str], offset: int, deadline: float, tally: Tally):
    """One client: queries back to back until the deadline or the request budget."""
    session = session_of(offset)
    with httpx.Client(timeout=cfg.timeout) as client:
        for text in client_texts(cfg, texts, offset, deadline, tally):
            started = time.perf_counter()
            try:
                server = one_query(client, url, text, cfg, m, session)
            except (httpx.HTTPError, RuntimeError, ValueError, KeyError) as err:
                tally.failed(err)
                continue
            tally.answered(time.perf_counter() - started, server)


class RawHTTP:
    """A minimal HTTP/1.1 keep-alive connection on asyncio streams: the light load generator.

    Twenty ``httpx`` clients in threads cost ~2 ms of CPU per query on the 2 cores the
    app is measured on; this costs a fraction of that. Enough HTTP for Gradio's
    answers: a status line, headers, a body by ``Content-Length`` or chunked.
    """

    def __init__(self, host: str, port: int, timeout: float):
        self.host, self.port, self.timeout = host, port, timeout
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(self, method: str, path: str, body: bytes = b"", on_chunk=None) -> tuple[int, bytes]:
        """Send one request; returns (status, body). ``on_chunk(bytes) -> bool``: stop reading when True."""
        if self.writer is None or self.writer.is_closing():
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        head = f"{method} {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
        if body:
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        self.writer.write(head.encode() + b"\r\n" + body)
        try:
            return await asyncio.wait_for(self._response(on_chunk), self.timeout)
        except BaseException:
            self.close()  # a half-read answer leaves the connection unusable
            raise

    async def _response(self, on_chunk) -> tuple[int, bytes]:
        status = int((await self.reader.readuntil(b"\r\n")).split()[1])
        headers = {}
        while (line := await self.reader.readuntil(b"\r\n")) != b"\r\n":
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        if headers.get("transfer-encoding", "").lower() == "chunked":
            parts = []
            while size := int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16):
                parts.append((await self.reader.readexactly(size + 2))[:-2])
                if on_chunk is not None:
                    on_chunk(parts[-1])
            await self.reader.readuntil(b"\r\n")  # the empty trailer
            body = b"".join(parts)
        else:
            body = await self.reader.readexactly(int(headers.get("content-length", 0)))
        if headers.get("connection", "").lower() == "close":
            self.close()
        return status, body

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


async def async_query(conn: RawHTTP, text: str, cfg: LoadConfig, m: int, session: str | None = None) -> float | None:
    """:func:`one_query` on a :class:`RawHTTP` connection (the ``call`` API: POST, then the event stream)."""
    if cfg.api == "json":  # the app's JSON route, outside Gradio
        status, body = await conn.request("GET", f"{JSON_ROUTE}?{urlencode(json_params(text, m, cfg))}")
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {body[:60]!r}")
        return _read_json(json.loads(body))
    if cfg.api == "run":  # one request, answered directly (outside the queue)
        run = json.dumps(run_body(text, m, cfg, session)).encode()
        status, body = await conn.request("POST", "/gradio_api/run/search_text", run)
        if status != 200:
            raise RuntimeError(f"HTTP {status} on POST: {body[:60]!r}")
        return _read_answer(run_outputs(json.loads(body), cfg))
    data = json.dumps(call_body(text, m, cfg, session)).encode()
    status, body = await conn.request("POST", "/gradio_api/call/search_text", data)
    if status != 200:
        raise RuntimeError(f"HTTP {status} on POST: {body[:60]!r}")
    event_id = json.loads(body)["event_id"]
    status, body = await conn.request("GET", f"/gradio_api/call/search_text/{event_id}")
    if status != 200:
        raise RuntimeError(f"HTTP {status} on the event stream")
    return _read_events(body.decode().splitlines())


def _read_events(lines: Iterable[str]) -> float | None:
    """The answer in an event stream's lines (``event: complete`` / ``error`` + ``data:`` lines), read up to it."""
    event = None
    for line in lines:
        if line.startswith("event:"):
            event = line.split(":", 1)[1].strip()
        elif line.startswith("data:") and event in ("complete", "error"):
            data = line.split(":", 1)[1].strip()
            if event == "error":
                raise RuntimeError(f"app error: {data[:80]}")
            return _read_answer(json.loads(data))
    raise RuntimeError("stream ended without an answer")


async def async_clients(cfg: LoadConfig, url: str, m: int, texts: list[str], deadline: float, tally: Tally) -> None:
    """``cfg.clients`` closed-loop clients as coroutines of one event loop, one connection each."""
    parsed = urlparse(url)
    port = parsed.port or 80

    async def client(offset: int) -> None:
        conn = RawHTTP(parsed.hostname, port, cfg.timeout)
        try:
            for text in client_texts(cfg, texts, offset, deadline, tally):
                started = time.perf_counter()
                try:
                    server = await async_query(conn, text, cfg, m, session_of(offset))
                except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, RuntimeError, ValueError, KeyError) as err:
                    tally.failed(err)
                    continue
                tally.answered(time.perf_counter() - started, server)
        finally:
            conn.close()

    await asyncio.gather(*(client(c) for c in range(cfg.clients)))


def gradio_client_loop(cfg: LoadConfig, url: str, m: int, texts: list[str], offset: int, deadline: float, tally: Tally):
    """One client as ``gradio_client.Client`` (what a Python user runs; heavier on the CPU)."""
    from gradio_client import Client

    client = Client(url, verbose=False, download_files=False)
    for text in client_texts(cfg, texts, offset, deadline, tally):
        started = time.perf_counter()
        try:
            gallery, status = client.predict(text, m, cfg.funnel, cfg.k, api_name="/search_text")
            if not gallery:
                raise RuntimeError(f"no results: {status[:80]}")
        except Exception as err:  # gradio_client raises its own kinds: count them all
            tally.failed(err)
            continue
        found = STATUS_MS.search(status)
        tally.answered(time.perf_counter() - started, float(found.group(1)) if found else None)


def run_load(cfg: LoadConfig) -> dict:
    """Run the load; returns the summary printed by the command."""
    url = check_local(cfg.url)
    if cfg.clients < 1 or cfg.seconds <= 0 or cfg.max_requests < 1:
        raise SystemExit("load_app: --clients, --seconds and --max-requests must be positive")
    if cfg.client == "gradio" and cfg.api != "call":
        raise SystemExit("load_app: --client gradio sends through Gradio's queue only (--api call)")
    m = cfg.m if cfg.m is not None else default_m(url)
    if cfg.api == "run" and cfg.run_batched is None:
        cfg = replace(cfg, run_batched=text_batched(url))
    texts = queries(cfg.seed, cfg.queries_from)
    with httpx.Client(timeout=cfg.timeout) as warm:  # one query first: model and caches warm, app answers
        one_query(warm, url, "a warm-up query", cfg, m)
    tally = Tally()
    server_cpu = process_cpu(cfg.server_pid)
    client_cpu = time.process_time()
    started = time.perf_counter()
    deadline = started + cfg.seconds
    if cfg.client == "async":
        asyncio.run(async_clients(cfg, url, m, texts, deadline, tally))
    else:
        loop = client_loop if cfg.client == "threads" else gradio_client_loop
        threads = [
            threading.Thread(target=loop, args=(cfg, url, m, texts, c, deadline, tally), daemon=True)
            for c in range(cfg.clients)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(cfg.seconds + cfg.timeout + 5)
    wall = time.perf_counter() - started
    client_cpu = time.process_time() - client_cpu
    server_cpu = process_cpu(cfg.server_pid) - server_cpu if cfg.server_pid else None
    ms = np.array(tally.latencies) * 1000
    pct = (lambda q: round(float(np.percentile(ms, q)), 1)) if len(ms) else (lambda q: None)
    server = np.array(tally.server_ms)
    return {
        "url": url,
        "endpoint": "search_text",
        "api": cfg.api,
        "client": cfg.client,
        "m": m,
        "funnel": cfg.funnel,
        "k": cfg.k,
        "distinct_queries": len(texts),
        "queries_from": cfg.queries_from or "made-up",
        "clients": cfg.clients,
        "seconds": round(wall, 1),
        "queries": len(ms),
        "errors": sum(tally.errors.values()),
        "error_kinds": dict(tally.errors),
        "throughput_qps": round(len(ms) / wall, 1),
        "p50_ms": pct(50),
        "p95_ms": pct(95),
        "p99_ms": pct(99),
        "max_ms": round(float(ms.max()), 1) if len(ms) else None,
        "app_search_p50_ms": round(float(np.median(server)), 1) if len(server) else None,
        "server_cpu_ms_per_query": round(1000 * server_cpu / len(ms), 2) if server_cpu is not None and len(ms) else None,
        "client_cpu_ms_per_query": round(1000 * client_cpu / len(ms), 2) if len(ms) else None,
        "load_average": round(os.getloadavg()[0], 2),
    }


def process_cpu(pid: int | None) -> float:
    """CPU seconds (user + system, all threads) a process on this machine has used; 0.0 without a pid."""
    if not pid:
        return 0.0
    try:
        fields = open(f"/proc/{pid}/stat", encoding="ascii").read().rsplit(")", 1)[1].split()
    except OSError:
        raise SystemExit(f"load_app: no process {pid} on this machine (--server-pid)") from None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def _m_choice(text: str) -> int | str:
    """``--m``: an m (``64``) or a byte budget's codes (``8B``), as the app's control takes them."""
    text = text.strip()
    if text.upper().endswith("B") and text[:-1].isdigit():
        return f"{int(text[:-1])}B"
    if text.isdigit():
        return int(text)
    raise argparse.ArgumentTypeError(f"expected an m like 64 or a budget like 8B, got {text!r}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="the running app, e.g. http://127.0.0.1:7860/")
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--max-requests", type=int, default=100_000)
    p.add_argument("--m", type=_m_choice, default=None,
                   help="m searched, or a byte budget's codes as 8B (index build --bytes) (default: the app's default, D)")
    p.add_argument("--funnel", action="store_true", help="shortlist at --m, re-rank at D")
    p.add_argument("-k", type=int, default=12)
    p.add_argument(
        "--api", choices=["call", "run", "json"], default="call",
        help="call: POST gradio_api/call + event stream, through Gradio's queue (default); run: one direct POST;"
        " json: GET the app's JSON route /triclip/api/search_text (outside Gradio)",
    )
    p.add_argument(
        "--client", choices=["async", "threads", "gradio"], default="async",
        help="async: one event loop, raw HTTP keep-alive (default, lightest); threads: an httpx client per thread;"
        " gradio: a gradio_client.Client per thread",
    )
    p.add_argument(
        "--queries-from", default=None,
        help="real queries: a .jsonl manifest (its first captions, e.g. demo/data/val.jsonl) or a file, one per line",
    )
    p.add_argument("--server-pid", type=int, default=None, help="the app's pid: also print its CPU ms per query")
    p.add_argument("--json", action="store_true")
    ns = p.parse_args(argv)
    cfg = LoadConfig(
        ns.url, ns.clients, ns.seconds, ns.max_requests, ns.m, ns.funnel, ns.k, api=ns.api, server_pid=ns.server_pid,
        client=ns.client, queries_from=ns.queries_from,
    )
    try:
        out = run_load(cfg)
    except httpx.HTTPError as err:
        raise SystemExit(f"load_app: cannot reach the app at {ns.url}: {err}") from None
    if ns.json:
        print(json.dumps(out))
    else:
        print(
            f"{out['queries']} text searches ({out['api']} API, {out['client']} clients) from {out['clients']} clients"
            f" in {out['seconds']} s, {out['distinct_queries']:,} distinct texts ({out['queries_from']})"
            f" (m = {out['m']}{', funnel' if out['funnel'] else ''}, k = {out['k']}): {out['throughput_qps']} queries/s\n"
            f"latency p50 {out['p50_ms']} ms, p95 {out['p95_ms']} ms, p99 {out['p99_ms']} ms, max {out['max_ms']} ms;"
            f" the app's own search time p50 {out['app_search_p50_ms']} ms\n"
            f"CPU per query: app {out['server_cpu_ms_per_query']} ms, these clients {out['client_cpu_ms_per_query']} ms;"
            f" load average {out['load_average']}\n"
            f"errors: {out['errors']}" + (f" {out['error_kinds']}" if out["errors"] else "")
        )
    return 1 if out["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
