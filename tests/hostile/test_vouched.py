"""Nothing served that the manifest does not vouch for: hostile cases, as tests that failed before.

A version's manifest records each file's size, a sampled sha256 and, for the codes of a byte
budget, the codec, count and width (``triclip.index.filecheck``). Codes swapped between
budgets, copied from another index of the same size, or of another codec are refused with one
line naming the file and what it holds; the budget is refused, the float index and the other
budgets still answer (codes are read on first use, ``triclip.index.lazy_codes``). A foreign
FAISS index, vectors or meta file refuses the version. An unreadable codes file says
permission, a FIFO or a directory says so. The app keeps serving the last good version when
a new one fails, and its API's m / bytes choices follow the version served. An ``hf:`` source
with no network is one line.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from tests.hostile.conftest import copy_tree, first_rows, one_line_error, run_triclip

ROWS = 36  # images in each of the two indexes (the same count: a foreign file passes a count check)
QUERY = "two red circles"


@pytest.fixture(scope="module")
def pair(tmp_path_factory, shapes, tiny_run) -> tuple[Path, Path]:
    """Two indexes of ``ROWS`` images each over different shapes images, D = 32, m = 8, PQ codes at 4 and 8 B."""
    from triclip.data.builtin import prepare
    from triclip.index.sources import IndexBuildConfig, build_index

    root = tmp_path_factory.mktemp("vouched")
    prepare("shapes", str(root / "shapes1"), num=44, seed=1)
    for name, data in (("a", shapes), ("b", root / "shapes1")):
        rows = first_rows(data / "train.jsonl", root / f"{name}.jsonl", ROWS)
        build_index(IndexBuildConfig(run=str(tiny_run), data=str(rows), out=str(root / name), dims=[8], bytes=[4, 8],
                                     codec="pq"))  # fmt: skip
    return root / "a", root / "b"


def live(index: Path) -> Path:
    from triclip.index.store import current_version

    return index / current_version(index)


def label(index: Path, budget: int) -> str:
    """What the manifest says the image codes of ``budget`` are, as messages write it (``pq8x5 m=32 (5 B)``)."""
    from triclip.codecs import CodecSpec

    spec = CodecSpec.from_json(json.loads((live(index) / "manifest.json").read_text())["budgets"][str(budget)]["spec"])
    return f"{spec.label()} ({spec.bytes_per_vector} B)"


def search(cli, index: Path, *extra) -> tuple[int, str, str]:
    return cli("search", "--index", index, "--text", QUERY, "-k", 5, "--json", *extra)


def answers(cli, index: Path, *extra) -> list[str]:
    status, out, err = search(cli, index, *extra)
    assert status == 0, err
    return [hit["id"] for hit in json.loads(out)]


def strip_records(version: Path) -> None:
    """The manifest of a version written before the file records."""
    manifest = json.loads((version / "manifest.json").read_text())
    manifest.pop("files", None)
    (version / "manifest.json").write_text(json.dumps(manifest))


# ---------------------------------------------------------------------------- codes


def test_swapped_codes_refuse_their_budgets_and_full_d_still_answers(cli, tmp_path, pair):
    index = copy_tree(pair[0], tmp_path / "index")
    v = live(index)
    os.rename(v / "image.b4.codec", v / "swap")
    os.rename(v / "image.b8.codec", v / "image.b4.codec")
    os.rename(v / "swap", v / "image.b8.codec")
    status, _, err = search(cli, index, "--bytes", 8)
    line = one_line_error(status, err)
    assert f"image.b8.codec holds {label(pair[0], 4)}, the manifest says {label(pair[0], 8)}" in line, line
    assert answers(cli, index) == answers(cli, pair[0])  # full D answers, as before the swap


def test_codes_of_another_index_are_refused_and_the_other_budget_answers(cli, tmp_path, pair):
    index = copy_tree(pair[0], tmp_path / "index")
    shutil.copy(live(pair[1]) / "image.b8.codec", live(index) / "image.b8.codec")
    assert label(pair[1], 8) == label(pair[0], 8)  # the same code, count and width: only the bytes differ
    status, _, err = search(cli, index, "--bytes", 8)
    line = one_line_error(status, err)
    assert "image.b8.codec" in line and "the manifest" in line and f"it holds {label(pair[0], 8)}" in line, line
    assert answers(cli, index, "--bytes", 4) == answers(cli, pair[0], "--bytes", 4)
    assert answers(cli, index) == answers(cli, pair[0])


@pytest.mark.parametrize("records", ["recorded", "written before the records"])
def test_opq_codes_under_a_manifest_that_says_pq_are_refused(cli, tmp_path, pair, records):
    from triclip.codecs import CodecSpec, fit

    index = copy_tree(pair[0], tmp_path / "index")
    v = live(index)
    if records != "recorded":
        strip_records(v)
    rng = np.random.default_rng(0)
    train = rng.standard_normal((300, 32)).astype(np.float32)
    opq = fit(CodecSpec("opq", 32, 8, {"M": 8, "nbits": 8}), train / np.linalg.norm(train, axis=1, keepdims=True))
    opq.add(np.load(v / "vectors.npy"))  # the index's own vectors: count and width agree
    opq.save(v / "image.b8.codec")
    status, _, err = search(cli, index, "--bytes", 8)
    line = one_line_error(status, err)
    assert f"image.b8.codec holds opq8x8 m=32 (8 B), the manifest says {label(pair[0], 8)}" in line, line
    assert label(pair[0], 8).startswith("pq8x")
    assert answers(cli, index, "--bytes", 4) == answers(cli, pair[0], "--bytes", 4)


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_fifo_or_a_directory_in_place_of_codes_is_named(cli, tmp_path, pair, kind):
    index = copy_tree(pair[0], tmp_path / "index")
    target = live(index) / "image.b8.codec"
    target.unlink()
    os.mkfifo(target) if kind == "fifo" else target.mkdir()
    status, _, err = search(cli, index, "--bytes", 8)
    line = one_line_error(status, err)
    assert ("a FIFO (named pipe)" if kind == "fifo" else "a directory") in line, line
    assert "missing" not in line and "damaged" not in line
    assert answers(cli, index) == answers(cli, pair[0])
    assert answers(cli, index, "--bytes", 4) == answers(cli, pair[0], "--bytes", 4)


@pytest.mark.slow
def test_unreadable_codes_say_permission_and_the_float_search_serves(tmp_path, pair):
    index = copy_tree(pair[0], tmp_path / "index")
    os.chmod(live(index) / "image.b8.codec", 0)
    args = ["search", "--index", index, "--text", QUERY, "-k", 5, "--json"]
    refused = run_triclip([*args, "--bytes", 8], tmp_path, unprivileged=True)
    line = one_line_error(refused.returncode, refused.stderr)
    assert "image.b8.codec: permission denied" in line and "damaged" not in line, line
    served = run_triclip(args, tmp_path, unprivileged=True)
    assert served.returncode == 0 and len(json.loads(served.stdout)) == 5, served.stderr


FIXED = """
import os, sys
from triclip.core.errors import UserError
from triclip.index.search import Searcher

index, codes = sys.argv[1], sys.argv[2]
searcher = Searcher.load(index)
query = searcher.vectors_of([searcher.contents.meta[0]["id"]])
try:
    searcher.search_vectors(query, k=3, bytes=8)
except UserError as err:
    print("refused:", err)
os.chmod(codes, 0o644)  # its owner may, without capabilities
print("answered:", len(searcher.search_vectors(query, k=3, bytes=8)[0]))
"""


@pytest.mark.slow
def test_a_budget_refused_for_permissions_answers_once_they_are_fixed(tmp_path, pair):
    """A permission error is not kept as the budget's verdict (the index is not damaged): the next search reads."""
    import subprocess
    import sys

    from tests.hostile.conftest import unprivileged_prefix

    index = copy_tree(pair[0], tmp_path / "index")
    codes = live(index) / "image.b8.codec"
    os.chmod(codes, 0)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[2]),
               TRICLIP_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run([*unprivileged_prefix(), sys.executable, "-c", FIXED, str(index), str(codes)], env=env,
                          text=True, capture_output=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "refused:" in proc.stdout and "permission denied" in proc.stdout and "answered: 3" in proc.stdout, proc.stdout


def test_an_index_written_before_the_records_still_loads_and_searches_its_codes(cli, tmp_path, pair):
    index = copy_tree(pair[0], tmp_path / "index")
    strip_records(live(index))
    assert answers(cli, index, "--bytes", 8) == answers(cli, pair[0], "--bytes", 8)
    assert answers(cli, index) == answers(cli, pair[0])


# ---------------------------------------------------------------------------- the other files of a version


@pytest.mark.parametrize("name", ["image.m8.faiss", "image.m32.faiss", "vectors.npy", "meta.jsonl"])
def test_a_file_of_another_index_of_the_same_size_is_refused(cli, tmp_path, pair, name):
    index = copy_tree(pair[0], tmp_path / "index")
    shutil.copy(live(pair[1]) / name, live(index) / name)
    line = one_line_error(*search(cli, index)[::2])
    assert f"{name} is " in line and "the manifest" in line and "rebuild" in line, line


def test_truncated_vectors_name_their_recorded_size(cli, tmp_path, pair):
    index = copy_tree(pair[0], tmp_path / "index")
    vectors = live(index) / "vectors.npy"
    size = vectors.stat().st_size
    vectors.write_bytes(vectors.read_bytes()[: size - 32 * 4])  # one row short
    line = one_line_error(*search(cli, index)[::2])
    assert f"vectors.npy is {size - 128:,} bytes, the manifest records {size:,}" in line, line


@pytest.mark.parametrize("name", ["vectors.npy", "meta.jsonl"])
def test_an_export_to_milvus_refuses_a_file_of_another_index(cli, tmp_path, pair, name):
    index = copy_tree(pair[0], tmp_path / "index")
    shutil.copy(live(pair[1]) / name, live(index) / name)
    db = tmp_path / "out.db"
    status, _, err = cli("index", "export", "--index", index, "--to", db)
    line = one_line_error(status, err)
    assert f"{name} is " in line and "the manifest" in line and "rebuild" in line, line
    assert not db.exists()  # refused before Milvus is reached


# ---------------------------------------------------------------------------- the app


def wait_for(condition, what: str, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def api_choices(url: str) -> list:
    """The m / bytes choices the API info lists for ``search_text``."""
    import httpx

    info = httpx.get(url + "gradio_api/info", timeout=30).json()["named_endpoints"]["/search_text"]["parameters"]
    return next(p for p in info if p["parameter_name"] == "m")["type"]["enum"]


def page_choices(url: str) -> list:
    """The m / bytes choices a newly opened page draws."""
    import httpx

    config = httpx.get(url + "config", timeout=30).json()
    radio = next(c for c in config["components"] if c["props"].get("elem_id") == "m")
    return [value for _, value in radio["props"]["choices"]]


def test_the_app_keeps_the_last_good_version_and_its_choices_follow_the_one_served(tmp_path, pair, tiny_run):
    import httpx

    from tests.app.conftest import serving
    from triclip.index.sources import IndexBuildConfig, build_index
    from triclip.index.store import _point_at

    index = copy_tree(pair[0], tmp_path / "index")
    with serving(index, follow=0.1) as (url, app):
        assert api_choices(url) == page_choices(url) == [8, 32, "4B", "8B"]
        build_index(IndexBuildConfig(run=str(tiny_run), data=str(pair[0].parent / "a.jsonl"), out=str(index), dims=[8],
                                     bytes=[8], codec="pq", overwrite=True))  # fmt: skip
        wait_for(lambda: app.live.view().version == "v000002", "the rebuilt version")
        assert api_choices(url) == page_choices(url) == [8, 32, "8B"]
        shutil.copytree(index / "v000002", index / "v000003")  # a version whose codes are another index's
        shutil.copy(live(pair[1]) / "image.b8.codec", index / "v000003" / "image.b8.codec")
        _point_at(index, "v000003")
        stamp = app.live._current_stamp()
        wait_for(lambda: app.live.view() and app.live._stamp == stamp and not app.live._loading, "the failed load")
        assert app.live.view().version == "v000002"
        answer = httpx.get(url + "triclip/api/search_text", params={"q": QUERY, "bytes": 8, "k": 5}, timeout=60).json()
        assert answer["version"] == "v000002" and len(answer["hits"]) == 5, answer
        assert api_choices(url) == page_choices(url) == [8, 32, "8B"]


# ---------------------------------------------------------------------------- the network


NO_NETWORK = """
import socket, sys, time
import huggingface_hub.utils._http as hub_http

def no_network(self, address):
    raise OSError(101, "Network is unreachable")

class NoWait:  # the client's back-off between retries, skipped (the retries themselves still happen)
    def __getattr__(self, name):
        return getattr(time, name)

    @staticmethod
    def sleep(seconds):
        return None

socket.socket.connect = no_network
hub_http.time = NoWait()
from triclip.app.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_an_hf_source_with_no_network_is_one_line(tmp_path):
    """No HF_HUB_OFFLINE: the hub client tries, logs, retries; what reaches stderr is our one line. A child
    process, so that the hub libraries read this environment when imported."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.endswith("_OFFLINE")}
    env.update(HF_HOME=str(tmp_path / "hf"), PYTHONPATH=str(Path(__file__).resolve().parents[2]),
               TRICLIP_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-c", NO_NETWORK, "data", "split", "hf:someone/not-cached-anywhere",
                           "--out", str(tmp_path / "out")], env=env, text=True, capture_output=True, timeout=300)
    assert "someone/not-cached-anywhere" in one_line_error(proc.returncode, proc.stderr)
    assert len([line for line in proc.stderr.splitlines() if line.strip()]) == 1, proc.stderr
