"""Serving the page: starting and stopping the server, the process's threads and log.

    launch(blocks, app, HOST, PORT, block=False)   # tests; triclip.app.gradio_app.serve for the CLI

Private by default: ``triclip.app.config.HOST`` (127.0.0.1), no share link, no analytics, nothing fetched from outside
hosts. Routes mounted beside Gradio's: the indexed images (``triclip.app.endpoints.IMAGE_ROUTE``)
and the JSON API (``triclip.app.json_api``).
"""

from __future__ import annotations

import logging
import os
import sys
import time

import gradio as gr
from starlette.routing import Route

from triclip.app.config import check_address
from triclip.app.endpoints import IMAGE_ROUTE, SearchApp
from triclip.app import gradio_patches
from triclip.app.gradio_patches import patient_localhost_check
from triclip.app.json_api import json_route
from triclip.app.panels import CSS, theme
from triclip.core.errors import UserError

log = logging.getLogger("triclip.app")


def launch(blocks: gr.Blocks, app: SearchApp, host: str, port: int, block: bool = True, sessions: int | None = None):
    """Start the server and return once it answers (``block=True``: then serve until Ctrl-C / SIGTERM).

    Gradio's own start-up lines (its local URL and the "set share=True" hint) are not printed.

    Raises:
        UserError: the address cannot be bound (port out of range or in use, unknown host).
    """
    check_address(host, port)
    direct_to(host)  # Gradio's launch asks its own server through httpx, which honours HTTP(S)_PROXY
    image_route = Route(IMAGE_ROUTE + "/{row:int}", app.image_response)  # before Gradio's own routes
    # gradio_client downloads every result file through Gradio's file route, with the result's
    # path, which is our image URL: answer those requests for our own images here as well.
    client_route = Route("/gradio_api/file=http{rest:path}", app.client_image_response)
    try:
        with patient_localhost_check():
            result = blocks.launch(
                server_name=host,
                server_port=port,
                share=False,
                inbrowser=False,
                app_kwargs={"routes": [image_route, client_route, json_route(app)]},
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
    except ValueError as err:  # Gradio's own check that its server answers on localhost (no share link here)
        if "localhost is not accessible" not in str(err):
            raise
        blocks.close()
        raise UserError(f"the app's server on {host}:{port} did not answer on localhost within"
                        f" {gradio_patches.LOCALHOST_PATIENCE:g} s: a busy machine, or an HTTP proxy that localhost"
                        " requests go through (set NO_PROXY=localhost,127.0.0.1)") from None
    if block:
        wait(blocks)
    return result


def direct_to(host: str) -> None:
    """Requests from this process to ``host`` and to localhost skip any HTTP proxy (``NO_PROXY`` / ``no_proxy``
    extended). ``Blocks.launch`` checks its new server with httpx requests to the served address, which go through
    ``HTTP_PROXY`` when one is set: behind a proxy ``triclip app`` ended in a traceback (the proxy refused, or
    answered for 127.0.0.1 itself). The app makes no request to any other host."""
    local = [host, "localhost", "127.0.0.1", "::1"]
    for key in ("NO_PROXY", "no_proxy"):
        names = [name.strip() for name in os.environ.get(key, "").split(",") if name.strip()]
        os.environ[key] = ",".join(names + [name for name in dict.fromkeys(local) if name not in names])


def wait(blocks: gr.Blocks) -> None:
    """Serve until Ctrl-C (or SIGTERM, see :func:`serve`), then close the server."""
    try:
        while blocks.is_running:
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    finally:
        blocks.close()


def log_to_stderr() -> None:
    """The app's own log lines (refused images, version swaps) on stderr, one line each."""
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("triclip app: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def set_threads(threads: int) -> None:
    """Threads each search may use in torch (and the ONNX Runtime sessions made after this) and FAISS: FAISS's in
    every thread that searches (OpenMP's count is per thread: ``triclip.codecs.threads``), not only this one."""
    import torch

    from triclip.codecs.threads import set_search_threads

    torch.set_num_threads(max(1, threads))
    set_search_threads(max(1, threads))


def interrupt(signum, frame):
    raise KeyboardInterrupt