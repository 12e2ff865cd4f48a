"""Text search through the exported text side (Searcher.load(text_only=True), triclip search --text).

A lite run with random heads, indexed over a dozen shapes images: the ONNX path must give
the torch path's hits and scores, load torch only for an image query, and ``triclip search
--text`` on it must not import torch at all.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from triclip.app.cli import main
from triclip.index.search import Searcher
from triclip.model import accel, text_onnx
from triclip.model.model import ModelConfig, build_model

QUERIES = ["two red circles", "a small blue square in the top left", "Ünïcödé 文字", "three large green triangles " * 30]
HEAVY = ("torch", "transformers", "open_clip", "timm", "torchvision")  # what the fast path must not import
ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not (accel.onnxruntime_available() and text_onnx.enabled()), reason="onnx / onnxruntime missing")


@pytest.fixture(scope="module")
def lite_index(tmp_path_factory, shapes_dir):
    """(index folder, cache folder): a lite run with random heads (an old-style weights file: every
    tensor) indexed at m = 8 and D = 16 over 12 shapes images."""
    root = tmp_path_factory.mktemp("fast")
    torch.manual_seed(0)
    cfg = ModelConfig(preset="lite", embed_dim=16)
    model = build_model(cfg)
    with torch.no_grad():
        model.theta.copy_(torch.randn(16))  # a non-trivial importance order and weights
    run = root / "run"
    run.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(run / "model.safetensors"))
    (run / "config.json").write_text(json.dumps({"model": cfg.to_dict(), "loss": "tricl"}))
    lines = (shapes_dir / "train.jsonl").read_text().splitlines()[:12]
    data = shapes_dir / "fast12.jsonl"
    data.write_text("\n".join(lines) + "\n")
    cache = root / "cache"
    old = os.environ.get("TRICLIP_CACHE")
    os.environ["TRICLIP_CACHE"] = str(cache)
    try:
        assert main(["index", "build", "--run", str(run), "--data", str(data), "--out", str(root / "index"), "--dims", "8",
                     "--bytes", "4"]) == 0
    finally:
        os.environ.pop("TRICLIP_CACHE") if old is None else os.environ.__setitem__("TRICLIP_CACHE", old)
    return root / "index", cache


@pytest.fixture
def cache_env(lite_index, monkeypatch):
    monkeypatch.setenv("TRICLIP_CACHE", str(lite_index[1]))
    return lite_index[1]


def _same_hits(fast, slow, tol=1e-4):
    for a, b in zip(fast, slow, strict=True):
        assert [h["id"] for h in a] == [h["id"] for h in b]
        np.testing.assert_allclose([h["score"] for h in a], [h["score"] for h in b], atol=tol)


def test_fast_text_search_matches_the_torch_path(lite_index, cache_env):
    index, _ = lite_index
    slow = Searcher.load(index)  # the torch path, as the app loads it
    first = Searcher.load(index, text_only=True)  # no export yet: torch, and it writes one
    assert first.text_encoder is None and first.model is not None and first.timings["text_export"] > 0
    fast = Searcher.load(index, text_only=True)
    assert fast.text_encoder is not None and fast.model is None
    np.testing.assert_allclose(fast.embed_texts(QUERIES), slow.embed_texts(QUERIES), atol=1e-4)
    for m in (8, None):
        _same_hits(fast.search_text(QUERIES, k=5, m=m), slow.search_text(QUERIES, k=5, m=m))
    _same_hits(fast.search_text(QUERIES, k=3, funnel=8), slow.search_text(QUERIES, k=3, funnel=8))
    image = json.loads((index / "v000001" / "meta.jsonl").read_text().splitlines()[2])["image"]
    assert fast.search_image([image], k=3) == slow.search_image([image], k=3)  # the model, loaded on demand
    assert fast.model is not None


def test_fast_searcher_is_thread_safe(lite_index, cache_env):
    from concurrent.futures import ThreadPoolExecutor

    index, _ = lite_index
    Searcher.load(index, text_only=True)  # the export, whatever ran before
    fast = Searcher.load(index, text_only=True)
    assert fast.text_encoder is not None
    serial = [fast.search_text([q], k=4)[0] for q in QUERIES] * 4
    image = json.loads((index / "v000001" / "meta.jsonl").read_text().splitlines()[1])["image"]
    with ThreadPoolExecutor(8) as pool:  # text queries, and image queries that load the model on demand, at once
        texts = list(pool.map(lambda q: fast.search_text([q], k=4)[0], QUERIES * 4))
        images = list(pool.map(lambda _: fast.search_image([image], k=2)[0], range(4)))
    assert texts == serial and all(hits == images[0] for hits in images)


@pytest.mark.parametrize("how", [[], ["--bytes", "4", "--rescore", "float"]], ids=["float", "codes"])
def test_search_text_cli_does_not_import_torch(lite_index, cache_env, how):
    index, cache = lite_index
    Searcher.load(index, text_only=True)  # makes sure the export exists (whatever ran before)
    options = {"bytes": 4, "rescore": "float"} if how else {}
    expected = Searcher.load(index).search_text(QUERIES[:1], k=4, **options)[0]
    code = (
        "import json, sys\n"
        "from triclip.app.cli import main\n"
        f"rc = main(['search', '--index', {str(index)!r}, '--text', {QUERIES[0]!r}, '-k', '4', '--json', '--timing',"
        f" *{how!r}])\n"
        f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})\n"
        "print('HEAVY ' + json.dumps(heavy), file=sys.stderr)\n"
        "sys.exit(rc)\n"
    )
    env = {**os.environ, "TRICLIP_CACHE": str(cache)}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    heavy = json.loads(done.stderr.split("HEAVY ", 1)[1].splitlines()[0])
    assert heavy == []
    timing = json.loads(done.stderr.split("timing: ", 1)[1].splitlines()[0])
    assert timing["text_encoder"] == "onnx"
    _same_hits([json.loads(done.stdout)], [expected])


def test_tiny_runs_keep_the_torch_path(run_dir, shapes_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TRICLIP_CACHE", str(tmp_path / "cache"))
    data = str(shapes_dir / "val.jsonl")
    assert main(["index", "build", "--run", str(run_dir), "--data", data, "--out", str(tmp_path / "index")]) == 0
    searcher = Searcher.load(tmp_path / "index", text_only=True)
    assert searcher.text_encoder is None and searcher.model is not None
    assert searcher.timings.get("text_export", 0.0) == 0.0
    assert not (tmp_path / "cache" / "text_encoder").exists()


def test_numpy_transform_matches_compact_transform():
    """The fast path applies the manifest's transform in numpy: the same maths as CompactTransform."""
    from triclip.index.search import _numpy_transform
    from triclip.compact.features import CompactTransform, PCABasis

    g = torch.Generator().manual_seed(0)
    z = torch.nn.functional.normalize(torch.randn(5, 12, generator=g), dim=-1)  # (Q, D)
    keep = torch.randperm(12, generator=g)
    selection = CompactTransform("importance", 12, 12, keep=keep, weights=torch.rand(12, generator=g) + 0.1,
                                 signs=torch.where(torch.rand(12, generator=g) < 0.5, -1.0, 1.0))  # fmt: skip
    q, _ = torch.linalg.qr(torch.randn(12, 12, generator=g))
    pca = CompactTransform("pca", 12, 12, basis=PCABasis(torch.randn(12, generator=g) * 0.1, q.T, torch.ones(12)))
    for transform in (selection, pca):
        manifest = {"transform": transform.to_dict(), "dim": 12}
        got = _numpy_transform(manifest, "I", 12)(z.numpy())
        np.testing.assert_allclose(got, transform(z).numpy(), atol=1e-6)
    with pytest.raises(Exception, match="dimension 12"):
        _numpy_transform({"transform": selection.to_dict(), "dim": 12}, "I", 16)


def test_the_app_searcher_embeds_texts_through_the_export_and_images_through_the_model(lite_index, cache_env):
    """``use_text_export`` (what ``triclip app`` calls): the model stays for image queries, texts take the export
    (written when missing), and the answers are the torch path's."""
    index, cache = lite_index
    shutil.rmtree(cache / "text_encoder", ignore_errors=True)  # no export yet: it is written
    slow = Searcher.load(index)
    served = Searcher.load(index)
    assert served.text_encoder is None and served.use_text_export() and served.text_encoder is not None
    assert served.model is not None and served.use_text_export()  # again: nothing to do
    np.testing.assert_allclose(served.embed_texts(QUERIES), slow.embed_texts(QUERIES), atol=1e-4)
    for m in (8, None):
        _same_hits(served.search_text(QUERIES, k=5, m=m), slow.search_text(QUERIES, k=5, m=m))
    calls, encode = [], served.text_encoder.encode
    served.text_encoder.encode = lambda texts: calls.append(len(texts)) or encode(texts)
    served.search_text(QUERIES, k=3)
    assert sum(calls) == len(QUERIES)  # every text query went through the export
    image = json.loads((index / "v000001" / "meta.jsonl").read_text().splitlines()[2])["image"]
    assert served.search_image([image], k=3) == slow.search_image([image], k=3)
    assert sum(calls) == len(QUERIES)  # an image query did not


def test_a_first_text_search_in_a_terminal_says_why_it_waits_and_the_next_one_is_quiet(lite_index, tmp_path,
                                                                                        monkeypatch):
    import io

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    index, _ = lite_index
    monkeypatch.setenv("TRICLIP_CACHE", str(tmp_path / "cache"))  # no export yet
    said = [Terminal(), Terminal()]
    loads = []
    for out in said:
        monkeypatch.setattr("sys.stderr", out)
        loads.append(Searcher.load(index, text_only=True))
    assert loads[0].text_encoder is None and loads[1].text_encoder is not None  # exported by the first
    assert said[0].getvalue().startswith("loading the run's model and exporting its text side, once")
    assert said[1].getvalue() == ""  # the export cached: nothing to wait for
