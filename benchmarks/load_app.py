"""Load test of a running ``triclip app``: concurrent text searches through its HTTP API.

Usage::

    triclip app --index demo/index --port 7860 &
    .venv/bin/python -m benchmarks.load_app --url http://127.0.0.1:7860/ --clients 20 --seconds 30

Each of ``--clients`` threads is one client with its own HTTP connection, sending one
search after another (a closed loop: the next query leaves when the last answer came
back) through Gradio's plain HTTP API: ``POST gradio_api/call/search_text`` queues the
query and returns an event id, ``GET gradio_api/call/search_text/<id>`` streams the
answer. The latency of a query is the time from the POST to the answer, so it includes
Gradio's queue. Queries are varied texts (colours x things x places: 2,400 distinct
ones, taken in a shuffled order), so no answer repeats a cached one.

Bounded: at most ``--seconds`` of sending and ``--max-requests`` queries in all, and
only to 127.0.0.1 / localhost (the command refuses any other host). Prints the
number of queries, throughput, p50 / p95 / p99 latency, the app's own search time
(embedding + FAISS, from the status line) and errors by kind; ``--json`` prints one
JSON object instead.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import re
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import urlparse

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
STATUS_MS = re.compile(r"· ([0-9.]+) ms")  # the app's search time in its status line


@dataclass
class LoadConfig:
    """What to send, how much and for how long."""

    url: str  # the app, e.g. http://127.0.0.1:7860/
    clients: int = 20  # concurrent clients (threads), each sending one query after another
    seconds: float = 30.0  # sending stops after this long
    max_requests: int = 100_000  # and after this many queries in all
    m: int | None = None  # the m searched (None: the app's default, D)
    funnel: bool = False  # funnel search: shortlist at m, re-rank at D
    k: int = 12  # results per query
    timeout: float = 30.0  # seconds one query may take before it counts as an error
    seed: int = 0  # order of the queries
    api: str = "call"  # call: through the app's queue, like the page and gradio_client; run: direct POST


@dataclass
class Tally:
    """What the clients saw (shared, under a lock)."""

    latencies: list[float] = field(default_factory=list)  # seconds per successful query
    server_ms: list[float] = field(default_factory=list)  # the app's own search time per query
    errors: Counter = field(default_factory=Counter)  # kind -> count
    sent: int = 0  # queries started
    lock: threading.Lock = field(default_factory=threading.Lock)


def queries(seed: int) -> list[str]:
    """2,400 distinct text queries in a shuffled order."""
    texts = [f"a {c} {t}{p}" for c, t, p in itertools.product(COLOURS, THINGS, PLACES)]
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


def one_query(client: httpx.Client, url: str, text: str, cfg: LoadConfig, m: int) -> float | None:
    """Send one search and wait for its answer; returns the app's search ms (None if absent).

    Raises:
        RuntimeError: the app answered with an error event (its message).
    """
    data = {"data": [text, m, cfg.funnel, cfg.k]}
    if cfg.api == "run":  # one request, answered directly (outside the queue)
        answer = client.post(url + "gradio_api/run/search_text", json=data)
        answer.raise_for_status()
        return _read_answer(answer.json()["data"])
    start = client.post(url + "gradio_api/call/search_text", json=data)
    start.raise_for_status()
    event_id = start.json()["event_id"]
    event = None
    with client.stream("GET", url + f"gradio_api/call/search_text/{event_id}") as stream:
        stream.raise_for_status()
        for line in stream.iter_lines():
            if line.startswith("event:"):
                event = line.split(":", 1)[1].strip()
            elif line.startswith("data:") and event in ("complete", "error"):
                data = line.split(":", 1)[1].strip()
                if event == "error":
                    raise RuntimeError(f"app error: {data[:80]}")
                return _read_answer(json.loads(data))
    raise RuntimeError("stream ended without an answer")


def _read_answer(outputs: list) -> float | None:
    """The app's search ms from an answer's outputs (gallery, status, ids kept for clicks)."""
    gallery, status = outputs[:2]
    if not gallery:
        raise RuntimeError(f"no results: {status[:80]}")
    found = STATUS_MS.search(status)
    return float(found.group(1)) if found else None


def client_loop(cfg: LoadConfig, url: str, m: int, texts: list[str], offset: int, deadline: float, tally: Tally):
    """One client: queries back to back until the deadline or the request budget."""
    with httpx.Client(timeout=cfg.timeout) as client:
        i = offset
        while time.perf_counter() < deadline:
            with tally.lock:
                if tally.sent >= cfg.max_requests:
                    return
                tally.sent += 1
            text = texts[i % len(texts)]
            i += cfg.clients
            started = time.perf_counter()
            try:
                server = one_query(client, url, text, cfg, m)
            except (httpx.HTTPError, RuntimeError, ValueError, KeyError) as err:
                with tally.lock:
                    tally.errors[f"{type(err).__name__}: {str(err)[:60]}"] += 1
                continue
            elapsed = time.perf_counter() - started
            with tally.lock:
                tally.latencies.append(elapsed)
                if server is not None:
                    tally.server_ms.append(server)


def run_load(cfg: LoadConfig) -> dict:
    """Run the load; returns the summary printed by the command."""
    url = check_local(cfg.url)
    if cfg.clients < 1 or cfg.seconds <= 0 or cfg.max_requests < 1:
        raise SystemExit("load_app: --clients, --seconds and --max-requests must be positive")
    m = cfg.m if cfg.m is not None else default_m(url)
    texts = queries(cfg.seed)
    with httpx.Client(timeout=cfg.timeout) as warm:  # one query first: model and caches warm, app answers
        one_query(warm, url, "a warm-up query", cfg, m)
    tally = Tally()
    started = time.perf_counter()
    deadline = started + cfg.seconds
    threads = [
        threading.Thread(target=client_loop, args=(cfg, url, m, texts, c, deadline, tally), daemon=True)
        for c in range(cfg.clients)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(cfg.seconds + cfg.timeout + 5)
    wall = time.perf_counter() - started
    ms = np.array(tally.latencies) * 1000
    pct = (lambda q: round(float(np.percentile(ms, q)), 1)) if len(ms) else (lambda q: None)
    server = np.array(tally.server_ms)
    return {
        "url": url,
        "endpoint": "search_text",
        "api": cfg.api,
        "m": m,
        "funnel": cfg.funnel,
        "k": cfg.k,
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
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="the running app, e.g. http://127.0.0.1:7860/")
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--max-requests", type=int, default=100_000)
    p.add_argument("--m", type=int, default=None, help="m searched (default: the app's default, D)")
    p.add_argument("--funnel", action="store_true", help="shortlist at --m, re-rank at D")
    p.add_argument("-k", type=int, default=12)
    p.add_argument(
        "--api", choices=["call", "run"], default="call",
        help="call: POST gradio_api/call + event stream, through the queue (default); run: one direct POST",
    )
    p.add_argument("--json", action="store_true")
    ns = p.parse_args(argv)
    cfg = LoadConfig(ns.url, ns.clients, ns.seconds, ns.max_requests, ns.m, ns.funnel, ns.k, api=ns.api)
    try:
        out = run_load(cfg)
    except httpx.HTTPError as err:
        raise SystemExit(f"load_app: cannot reach the app at {ns.url}: {err}") from None
    if ns.json:
        print(json.dumps(out))
    else:
        print(
            f"{out['queries']} text searches ({out['api']} API) from {out['clients']} clients in {out['seconds']} s"
            f" (m = {out['m']}{', funnel' if out['funnel'] else ''}, k = {out['k']}): {out['throughput_qps']} queries/s\n"
            f"latency p50 {out['p50_ms']} ms, p95 {out['p95_ms']} ms, p99 {out['p99_ms']} ms, max {out['max_ms']} ms;"
            f" the app's own search time p50 {out['app_search_p50_ms']} ms\n"
            f"errors: {out['errors']}" + (f" {out['error_kinds']}" if out["errors"] else "")
        )
    return 1 if out["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
