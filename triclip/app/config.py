"""The settings of ``triclip app`` and ``triclip demo``, and where the app listens by default.

Torch- and Gradio-free on purpose: the command line builds its options from these classes
(``triclip.app.options``) and checks them (:func:`check_app`, :func:`check_demo`) before
anything loads. ``HOST`` and ``PORT`` are the one definition of the app's address.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, replace

from triclip.core.config import bounded, check_fields, check_device
from triclip.core.errors import UserError

HOST = "127.0.0.1"  # the app's address by default: this machine only
PORT = 7860  # the app's port by default (Gradio's)
SERVE_ONLY = ("follow", "k", "concurrency", "max_query_chars", "queue_size", "batch", "sessions", "threads")  # AppConfig
# fields ``triclip app`` does not offer as options (their defaults serve)


@dataclass
class AppConfig:
    """How ``triclip app`` serves an index."""

    index: str  # index folder to serve (triclip index build --out); the app follows its updates
    host: str = HOST  # address to listen on; 127.0.0.1 is this machine only
    port: int = PORT  # port to listen on (1-65535, checked with the address)
    run: str | None = None  # run to embed queries with (None: the run recorded in the index)
    device: str | None = None  # cpu, cuda, cuda:1 for the query model (None: cuda when available, else cpu)
    collection: str | None = None  # with a Milvus --index: the collection (None: its one triclip collection)
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


@dataclass
class DemoConfig:
    """What ``triclip demo`` builds and serves."""

    workdir: str = "demo"  # where the data, runs and index go; everything the demo writes lives here
    host: str = HOST  # the app's address (127.0.0.1: this machine only)
    port: int = PORT  # the app's port
    epochs: int | None = bounded(None, low=1)  # MRL's heads-only epochs over the cached tower outputs (None: 20)
    embed_dim: int = bounded(256, low=1)  # D (not an option)
    dims: list[int] = bounded(default_factory=lambda: [16, 32, 64, 256], low=1)  # m's of the index folder, each at most D = 256
    # (training evaluates the compact curve at D/16, D/8, D/4, so the app shows the recall measured at each of these)
    bytes: list[int] = bounded(default_factory=lambda: [4, 8, 16, 32], low=1, help=(
        "byte budgets of the index's codes, each at most 4 x D = 1024 (the default 4,8,16,32: 95/97/100/99% of full-D"
        " recall, docs/results_bytes.md); '' for none"))  # each stores the code with the best recall measured on val
    serve: bool = True  # start the app at the end (--no-serve: build everything, do not start the app)
    num: int | None = bounded(None, low=1)  # use at most N openclipart records, a quick look (None: all 8,121)


@dataclass
class JsonOutput:
    """How a command prints its result."""

    json: bool = False  # print one JSON object (instead of a table)


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


def check_app(cfg: AppConfig) -> None:
    """UserError (one line) for an app that cannot serve, found before anything loads: the address, the device's
    name, the index (its manifest) and the run being there."""
    from triclip.index.versions import peek_manifest
    from triclip.model.runfile import read_config

    check_fields(cfg)
    check_device(cfg.device)
    check_address(cfg.host, cfg.port)
    from triclip.index.milvus import is_milvus_uri

    if is_milvus_uri(cfg.index):
        pass  # a collection: checked when it is opened (its record names the run)
    elif cfg.collection is not None:
        raise UserError("--collection names a Milvus collection: give a Milvus --index (PATH.db or http://HOST:19530)")
    else:
        peek_manifest(cfg.index)  # UserError: not an index
    if cfg.run is not None:
        read_config(cfg.run)  # UserError: not a run


def check_demo(cfg: DemoConfig) -> DemoConfig:
    """UserError (one line) for settings the demo cannot build, found before any data, training or index:
    bounds, every m at most D, every budget at most the float vectors' size (4 x D), and the address when it
    serves. Returns ``cfg`` with its m's and budgets sorted, each once."""
    from triclip.index.config import check_dims, check_width

    check_fields(cfg)
    check_dims(cfg.dims)
    check_width(cfg.embed_dim, cfg.dims, "--dims")
    check_width(cfg.embed_dim, cfg.bytes, "--bytes")
    if cfg.serve:
        check_address(cfg.host, cfg.port)
    elif (cfg.host, cfg.port) != (HOST, PORT):
        raise UserError("--no-serve builds everything and starts no app: --host and --port do not apply")
    return replace(cfg, dims=sorted(set(cfg.dims)), bytes=sorted(set(cfg.bytes)))
