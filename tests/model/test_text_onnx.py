"""The exported text side of a lite run (triclip.model.text_onnx) against the torch model, and its cache rules."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from triclip.model import accel, text_onnx  # noqa: E402
from triclip.model.model import ModelConfig, build_model  # noqa: E402

CAPTIONS = [
    "a cat",
    "red apple on a wooden table, drawn as clip art with thick outlines",
    "house, tree, garden, sun, cloud, road, car, bicycle, dog, fence, window, door, roof, chimney, smoke",
    "Ünïcödé 文字 and emoji 🙂",
    "many words " * 200,  # past max_length: truncated
    "   padded   WITH  Spaces  ",
]
TOL = 1e-4  # values of the unit embedding, ONNX Runtime (fused kernels) against eager torch

pytestmark = pytest.mark.skipif(not (accel.onnxruntime_available() and text_onnx.enabled()), reason="onnx / onnxruntime missing")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = build_model(ModelConfig(preset="lite", embed_dim=16, text_max_length=64)).eval()
    return m


@pytest.fixture
def run(tmp_path, monkeypatch):
    """A stand-in run folder (config + weights files whose stamps the entry records)."""
    monkeypatch.setenv("TRICLIP_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"weights")
    return folder


def _export(model, run, fingerprint="f00d"):
    return text_onnx.export_text_encoder(model, run, "best", fingerprint, [run / "config.json", run / "model.safetensors"])


def test_exported_encoder_matches_torch(model, run):
    _export(model, run)
    encoder = text_onnx.cached_text_encoder(run, "best", "f00d")
    assert encoder is not None and encoder.dim == 16
    tokens = model.tokenize(CAPTIONS)
    mine = encoder.tokenize(CAPTIONS)
    for key in text_onnx.INPUTS:  # the same tokens as transformers' tokenizer, truncation and padding included
        np.testing.assert_array_equal(mine[key], tokens[key].numpy())
    assert mine["input_ids"].shape[1] == 64
    with torch.no_grad():
        expected = model.encode_text(CAPTIONS).numpy()  # (B, D), eager torch
    got = encoder.encode(CAPTIONS)
    assert got.shape == expected.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, expected, atol=TOL)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    for i, caption in enumerate(CAPTIONS):  # alone (no padding) = in a padded batch
        np.testing.assert_allclose(encoder.encode([caption])[0], expected[i], atol=TOL)


def test_a_residual_head_exports_too(run):
    torch.manual_seed(1)
    model = build_model(ModelConfig(preset="lite", embed_dim=16, text_max_length=64, head="residual")).eval()
    _export(model, run)
    with torch.no_grad():
        expected = model.encode_text(CAPTIONS[:3]).numpy()  # (3, D): skip + MLP branch, eager torch
    got = text_onnx.cached_text_encoder(run, "best", "f00d").encode(CAPTIONS[:3])
    np.testing.assert_allclose(got, expected, atol=TOL)


def test_cache_misses(model, run, monkeypatch):
    entry = _export(model, run)
    assert text_onnx.cached_text_encoder(run, "best", "f00d") is not None
    assert text_onnx.cached_text_encoder(run, "best", "beef") is None  # another fingerprint: another entry
    assert text_onnx.cached_text_encoder(run, "last", "f00d") is None  # other weights of the run
    monkeypatch.setenv("TRICLIP_ACCEL", "eager")  # the torch path asked for
    assert text_onnx.cached_text_encoder(run, "best", "f00d") is None
    monkeypatch.delenv("TRICLIP_ACCEL")
    (run / "model.safetensors").write_bytes(b"retrained")  # the run changed after the export
    assert text_onnx.cached_text_encoder(run, "best", "f00d") is None
    _export(model, run)  # exported again: valid again
    assert text_onnx.cached_text_encoder(run, "best", "f00d") is not None
    (entry / text_onnx.ONNX_FILE).write_bytes(b"not onnx")  # a damaged entry is a miss, not an error
    assert text_onnx.cached_text_encoder(run, "best", "f00d") is None


def test_only_the_minilm_tower_is_exported():
    tiny = build_model(ModelConfig(preset="tiny", embed_dim=8))
    assert not text_onnx.exportable(tiny)
    with pytest.raises(ValueError, match="lite"):
        text_onnx.export_text_encoder(tiny, "nowhere", "best", "f00d", [])


def test_export_for_run_is_best_effort(model, run, monkeypatch, capsys):
    tiny = build_model(ModelConfig(preset="tiny", embed_dim=8))
    assert text_onnx.export_for_run(tiny, run, "best", "f00d") == 0.0  # nothing to export
    assert not text_onnx.cache_root().exists()

    def broken(*args, **kwargs):
        raise RuntimeError("exporter says no")

    monkeypatch.setattr(text_onnx, "export_text_encoder", broken)
    assert text_onnx.export_for_run(model, run, "best", "f00d") >= 0.0  # the caller's work goes on
    assert "could not cache the text encoder for fast searches (exporter says no)" in capsys.readouterr().err
    assert text_onnx.cached_text_encoder(run, "best", "f00d") is None


def test_a_new_export_of_a_run_replaces_its_older_ones(model, run, tmp_path):
    old = _export(model, run, fingerprint="0001")
    other_run = tmp_path / "other"
    other_run.mkdir()
    kept = _export(model, other_run, fingerprint="0001")  # another run: untouched
    new = _export(model, run, fingerprint="0002")  # the run retrained
    assert new.is_dir() and kept.is_dir() and not old.exists()
    assert text_onnx.cached_text_encoder(run, "best", "0002") is not None


def test_an_export_removes_the_entries_of_deleted_runs(model, run, tmp_path):
    gone = tmp_path / "deleted-run"
    gone.mkdir()
    orphan = _export(model, gone, fingerprint="0001")
    shutil.rmtree(gone)  # the user deleted that run; its ~90 MB export would stay forever
    assert orphan.is_dir()
    fresh = _export(model, run, fingerprint="0003")
    assert fresh.is_dir() and not orphan.exists()


def test_a_head_solved_on_a_run_exports_too(run):
    """``solve --run`` heads: the run's head, its sqrt(w) weights, normalisation, then an affine map."""
    torch.manual_seed(2)
    model = build_model(ModelConfig(preset="lite", embed_dim=16, text_max_length=64, head="mlp", post_affine=True)).eval()
    with torch.no_grad():
        model.text_head.scale.uniform_(0.2, 2.0)  # (D,) not all ones: the export must carry them
        model.text_head.post.weight.normal_()
    _export(model, run)
    with torch.no_grad():
        expected = model.encode_text(CAPTIONS[:3]).numpy()
    got = text_onnx.cached_text_encoder(run, "best", "f00d").encode(CAPTIONS[:3])
    np.testing.assert_allclose(got, expected, atol=TOL)


def test_sessions_take_omp_num_threads_else_torchs_count(monkeypatch):
    """A server sets torch's thread count (triclip.app.server.set_threads); the text export's session follows it."""
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert text_onnx._default_threads() == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert text_onnx._default_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_an_export_removes_what_a_killed_export_of_the_same_entry_left(model, run):
    entry = text_onnx.entry_dir(run, "best", "f00d")
    entry.parent.mkdir(parents=True)
    left = entry.parent / f".{entry.name}.tmp-killed"  # a kill -9 between temp_dir and swap_dir leaves this
    left.mkdir()
    (left / text_onnx.ONNX_FILE).write_bytes(b"half an export")
    other = entry.parent / ".another-entry.tmp-x"  # another entry's staging: not this export's to remove
    other.mkdir()
    assert _export(model, run) == entry
    assert not left.exists() and other.exists()
    assert text_onnx.cached_text_encoder(run, "best", "f00d") is not None
