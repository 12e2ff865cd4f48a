"""The demo end to end on a few hundred real openclipart records (slow: real lite towers)."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from triclip.app.demo import DemoConfig, run_demo

pytestmark = pytest.mark.slow


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRICLIP_CACHE", str(tmp_path / "cache"))


def test_demo_builds_run_and_index_then_reuses_everything(tmp_path, own_cache, capsys):
    if not os.path.isdir("/usr/share/openclipart/png"):
        pytest.skip("Debian openclipart-png is not installed (scripts/setup.sh installs it)")
    cfg = DemoConfig(workdir=str(tmp_path / "demo"), num=240, epochs=2, dims=[16, 64, 256], serve=False)
    first = run_demo(cfg)
    assert first["metrics"]["t2i_r10"] > 0.0
    from triclip.index.search import Searcher

    searcher = Searcher.load(first["index"])
    assert searcher.dims == [16, 64, 256]
    assert searcher.budgets == [4, 8, 16, 32] and len(searcher.contents.codes[4]) == len(searcher)  # codes of every split
    assert all(e["split"] == "validation" for e in searcher.manifest["budgets"].values())  # chosen on val
    splits = ("train", "val", "test")
    records = sum(1 for split in splits for _ in open(tmp_path / "demo" / "data" / f"{split}.jsonl"))
    assert len(searcher) == records  # every image of the three splits, nothing dropped or doubled
    version = Path(first["index"]) / (Path(first["index"]) / "CURRENT").read_text().strip()
    assert json.loads((version / "curves.json").read_text())  # recall against m, measured on val
    hit = searcher.search_text(["a red apple"], k=3, m=16)[0]
    assert len(hit) == 3 and hit[0]["score"] >= hit[-1]["score"]

    run, mrl, solved = (tmp_path / "demo" / name for name in ("run", "mrl", "solved"))
    assert json.loads((mrl / "config.json").read_text())["loss"] == "mrl"  # train's default
    on = json.loads((solved / "config.json").read_text())
    assert on["model"]["post_affine"] and Path(on["solver"]["run"]) == mrl  # Eq. 6 solved on MRL's embeddings
    config = json.loads((run / "config.json").read_text())
    assert config["loss"] == "tricl" and config["model"]["post_affine"] and Path(config["train"]["init"]) == solved
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 10  # the recipe's 10 epochs, whatever --epochs says
    from triclip.model.run import load_run

    w = load_run(run)[0].importance().detach()
    assert float(w.max()) > 2 * float(w.min())  # a spectrum (the canonical correlations, trained), not a flat line
    files = [run / "model.safetensors", solved / "model.safetensors", mrl / "model.safetensors", mrl / "metrics.jsonl"]
    stamps = {p: p.stat().st_mtime_ns for p in files}
    cache_files = sorted(os.listdir(tmp_path / "cache" / "features"))
    capsys.readouterr()
    second = run_demo(cfg)  # everything is there: nothing is trained, solved, cached or indexed again
    assert second["metrics"] == json.loads(json.dumps(first["metrics"]))
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    assert sorted(os.listdir(tmp_path / "cache" / "features")) == cache_files
    assert "caching locked" not in capsys.readouterr().err

    config["model"]["post_affine"], config["model"]["head"] = False, "residual"  # an older demo's run (tricl from a tower solve)
    config["train"]["init"] = str(tmp_path / "demo" / "solve")
    (run / "config.json").write_text(json.dumps(config))
    current = (Path(first["index"]) / "CURRENT").read_text()
    run_demo(cfg)
    assert "older recipe" in capsys.readouterr().out
    assert json.loads((run / "config.json").read_text())["model"]["post_affine"]
    assert all(p.stat().st_mtime_ns == stamps[p] for p in files[1:])  # MRL and the solve are not redone
    previous = tmp_path / "demo" / "previous-run"  # the older run is kept, not replaced: the rollback index needs it
    assert json.loads((previous / "config.json").read_text())["model"]["head"] == "residual"
    assert (previous / "model.safetensors").exists()
    assert (Path(first["index"]) / "CURRENT").read_text() != current  # the index of the new run, not the old one

    (tmp_path / "demo" / "data" / "test.jsonl").unlink()  # a work folder from before the test split
    third = run_demo(cfg)
    assert "predates the deduplicated split" in capsys.readouterr().out
    assert (tmp_path / "demo" / "data" / "test.jsonl").exists()
    assert len(Searcher.load(third["index"])) == records  # rebuilt over the same three splits


@contextlib.contextmanager
def ctrl_c_reaches_children():
    """Children started inside get SIGINT at its default, so their Python installs its KeyboardInterrupt handler.

    A suite started from a background job (``cmd &``, nohup, some CI runners) ignores SIGINT, and an ignored
    disposition is inherited across exec: the demo would then never see the Ctrl-C this test sends. A caught one
    is reset to the default by exec, so SIGINT is caught here while the child starts. Not ``preexec_fn``: it makes
    subprocess fork() this whole process, and after the Milvus tests gRPC's threads live here; its fork handlers
    then restart a poller whose epoll descriptor the child closes before exec, and the child aborts (SIGABRT,
    "epoll_wait error: Bad file descriptor"; 7 of 400 starts with pymilvus loaded, 0 of 400 without preexec_fn).
    """
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_child_gets_ctrl_c_even_when_the_suite_ignores_it():
    probe = [sys.executable, "-c", "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"]
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as in a suite started with `cmd &`
    try:
        ignored = subprocess.run(probe, capture_output=True, text=True, check=True).stdout.split()
        with ctrl_c_reaches_children():
            reached = subprocess.run(probe, capture_output=True, text=True, check=True).stdout.split()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # the suite's own disposition is given back
    finally:
        signal.signal(signal.SIGINT, before)
    assert ignored == ["False"] and reached == ["True"]


@pytest.fixture(scope="module")
def built_demo(tmp_path_factory):
    """A small demo built once (``--no-serve``, its own cache): the arguments and environment that serve it again."""
    if not os.path.isdir("/usr/share/openclipart/png"):
        pytest.skip("Debian openclipart-png is not installed (scripts/setup.sh installs it)")
    work = tmp_path_factory.mktemp("served")
    args = ["--workdir", str(work / "demo"), "--num", "240", "--epochs", "2", "--dims", "16,64,256"]
    env = {**os.environ, "TRICLIP_CACHE": str(work / "cache")}
    subprocess.run([sys.executable, "-m", "triclip", "demo", *args, "--no-serve"], check=True, capture_output=True, env=env)
    return args, env


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl_c", "sigterm"])
def test_demo_command_serves_the_built_demo_fast_and_stops_on_ctrl_c(built_demo, stop):
    """``triclip demo`` a second time: reuses everything, serves within 60 s on --port; Ctrl-C (SIGINT) or SIGTERM
    (``kill``) exits 0, as its --help says."""
    from gradio_client import Client

    from tests.app.conftest import free_port

    args, env = built_demo
    port = free_port()
    started = time.perf_counter()
    with ctrl_c_reaches_children():
        proc = subprocess.Popen(
            [sys.executable, "-m", "triclip", "demo", *args, "--port", str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
    try:
        url = f"http://127.0.0.1:{port}/"
        while time.perf_counter() - started < 60:
            assert proc.poll() is None, proc.communicate()
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        serving = time.perf_counter() - started
        assert serving < 60, f"not serving after {serving:.0f} s"
        client = Client(url, verbose=False, download_files=False)
        gallery, status = client.predict("a red apple", 64, True, 5, api_name="/search_text")
        client.close()  # its heartbeat stream is not left open to the server being stopped
        assert len(gallery) == 5 and "funnel: shortlist at m = 64" in status
        config = httpx.get(url + "config", timeout=30).json()  # the page as served: the feature-selection panel
        shown = {c["props"].get("elem_id"): c["props"] for c in config["components"] if c["props"].get("elem_id")}
        words = shown["spectrum"]["value"]
        assert "**Importance S** of 256 dimensions" in words and "Suggested m = " in words  # the spectrum S
        assert "recall-chart" in shown and "spectrum-plot" in shown
    finally:
        proc.send_signal(stop)  # Ctrl-C, or kill
        try:
            out, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:  # never leave the server running, whatever failed
                proc.kill()
                proc.communicate()
    assert proc.returncode == 0, err
    assert "Traceback" not in err and f"http://127.0.0.1:{port}/" in out
    assert "leaked" not in err  # no teardown noise from extension modules (nanobind)


def test_app_and_demo_help_say_how_they_stop(capsys):
    from triclip.app.cli import main

    for command in ("app", "demo"):
        with pytest.raises(SystemExit) as done:
            main([command, "--help"])
        assert done.value.code == 0
        assert "until Ctrl-C or SIGTERM" in " ".join(capsys.readouterr().out.split())
