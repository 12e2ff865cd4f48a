"""Fixtures for the app tests: a tiny index folder at several m, and the app serving it.

The index is built from an untrained ``tiny`` run (tests/index/conftest.py's
``make_run``: seeded weights and a random importance) over ~90 shapes images, at
m = 8, 16 and D = 32, with caption vectors. The app runs in this process on a free
port of 127.0.0.1 and is closed after the module's tests.
"""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path

import pytest

from tests.index.conftest import GivenLatency, make_run

DIMS = [8, 16]  # m's of the test index besides D = 32


def free_port() -> int:
    """A port of 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def app_index(tmp_path_factory) -> Path:
    """A tiny index folder (shapes, untrained tiny run) at m = 8, 16, 32, with captions."""
    from triclip.index.sources import IndexBuildConfig, build_index
    from triclip.data.builtin import prepare

    root = tmp_path_factory.mktemp("app")
    prepare("shapes", str(root / "data"), num=100, seed=0)
    run = make_run(root / "run", seed=0)
    build_index(IndexBuildConfig(run=str(run), data=str(root / "data" / "train.jsonl"), out=str(root / "index"), dims=DIMS))
    return root / "index"


def small_index(root: Path, num: int = 40, seed: int = 0, **options) -> Path:
    """A fresh index of ``num`` shapes images (untrained tiny run) at ``root/index``, for tests that change it."""
    from triclip.index.sources import IndexBuildConfig, build_index
    from triclip.data.builtin import prepare

    prepare("shapes", str(root / "data"), num=num, seed=seed)
    run = make_run(root / "run", seed=seed)
    data = str(root / "data" / "train.jsonl")
    with pytest.MonkeyPatch.context() as patch:  # the choice of a budget's code is by recall, not by this machine's load
        patch.setattr("triclip.index.budgets.latency_model", lambda: GivenLatency())
        build_index(IndexBuildConfig(run=str(run), data=data, out=str(root / "index"), dims=DIMS, **options))
    return root / "index"


@contextlib.contextmanager
def serving(index: Path, **config):
    """The app over ``index`` on a free port of 127.0.0.1 (``AppConfig`` fields in ``config``); yields (URL, SearchApp)."""
    from triclip.app.gradio_app import AppConfig, build_app, launch
    from triclip.index.search import Searcher

    port = free_port()
    blocks, app = build_app(Searcher.load(index), AppConfig(index=str(index), port=port, **config))
    launch(blocks, app, "127.0.0.1", port, block=False)
    try:
        yield f"http://127.0.0.1:{port}/", app
    finally:
        blocks.close()


@pytest.fixture(scope="module")
def app_url(app_index):
    """The app over ``app_index``, served on a free port; yields its URL."""
    from triclip.app.gradio_app import AppConfig, build_app, launch
    from triclip.index.search import Searcher

    searcher = Searcher.load(app_index)
    port = free_port()
    blocks, app = build_app(searcher, AppConfig(index=str(app_index), port=port))
    launch(blocks, app, "127.0.0.1", port, block=False)
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        blocks.close()


@pytest.fixture
def not_an_image(tmp_path) -> str:
    path = tmp_path / "notes.png"  # an image's name, not an image's bytes
    path.write_text("this is a text file, not a picture\n" * 20)
    return str(path)


@pytest.fixture
def bomb(tmp_path) -> str:
    """A 12,000 x 12,000 PNG (144 M pixels, ~20 KB on disk): over every pixel limit."""
    from PIL import Image

    path = tmp_path / "bomb.png"
    Image.new("1", (12_000, 12_000)).save(path, optimize=True)
    assert os.path.getsize(path) < 1_000_000
    return str(path)
