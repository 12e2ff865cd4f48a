"""``triclip embed``: shards equal across rank counts, resume skips finished shards, the vectors of docs/CONTRACT.md "Embeddings"."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

import triclip.model.shards as shards
from triclip.app.cli import main
from triclip.compact.features import make_transform
from triclip.data import load_pairs
from triclip.model.embed import embed_pairs
from triclip.core.errors import UserError
from triclip.model.run import load_run
from triclip.model.shards import EmbedConfig, embed_to_shards, load_shard, read_manifest
from tests.index.conftest import make_run

SHARD = 16  # records per shard: the ~90 training records make 6 shards


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    from triclip.data.builtin import prepare

    out = tmp_path_factory.mktemp("shapes")
    prepare("shapes", str(out), num=100, seed=0)
    return out / "train.jsonl"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return make_run(tmp_path_factory.mktemp("runs") / "run", seed=0)


def _cfg(run, data, out, **kw) -> EmbedConfig:
    return EmbedConfig(run=str(run), data=str(data), out=str(out), shard_size=SHARD, **kw)


def _union(emb: Path) -> tuple[np.ndarray, np.ndarray, list[dict]]:
    """All shards concatenated in shard order: image vectors, text vectors, meta rows."""
    manifest = read_manifest(emb)
    parts = [load_shard(emb, s, mmap=False) for s in range(manifest["num_shards"])]
    return (
        np.concatenate([p["image"] for p in parts]),
        np.concatenate([p["text"] for p in parts]),
        [row for p in parts for row in p["meta"]],
    )


@pytest.fixture(scope="module")
def single(run, data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("emb") / "single"
    summary = embed_to_shards(_cfg(run, data, out))
    assert summary["written"] == summary["shards"] == 6 and summary["reused"] == 0
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, cfg: EmbedConfig, error: str | None = None) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    if error is not None:  # rank 0 finds the problem; every rank reports it instead of waiting forever
        with pytest.raises(UserError, match=error):
            embed_to_shards(cfg)
        return
    summary = embed_to_shards(cfg)
    assert summary["world"] == world and summary["finished"] == summary["shards"]


def test_two_gloo_ranks_write_the_shards_of_one_process(run, data, single, tmp_path):
    out = tmp_path / "double"
    mp.spawn(_rank_main, args=(2, _free_port(), _cfg(run, data, out)), nprocs=2, join=True)
    img1, txt1, meta1 = _union(single)
    img2, txt2, meta2 = _union(out)
    np.testing.assert_allclose(img2, img1, rtol=0, atol=1e-6)
    np.testing.assert_allclose(txt2, txt1, rtol=0, atol=1e-6)
    assert [r["id"] for r in meta2] == [r["id"] for r in meta1]
    assert len({r["id"] for r in meta1}) == len(meta1) == len(load_pairs(data).records)
    ranks = [json.loads((out / shards.shard_name(s) / shards.SHARD_INFO).read_text())["rank"] for s in range(6)]
    assert ranks == [0, 1, 0, 1, 0, 1]  # rank r took shards r, r + 2, ...
    assert read_manifest(out)["transform"] == read_manifest(single)["transform"]
    other = make_run(tmp_path / "other", seed=1)
    mp.spawn(_rank_main, args=(2, _free_port(), _cfg(other, data, out), "fingerprint"), nprocs=2, join=True)


def test_resume_recomputes_only_missing_shards(run, data, single, tmp_path, monkeypatch):
    out = tmp_path / "resumed"
    shutil.copytree(single, out)
    shutil.rmtree(out / "shard-00003")
    (out / ".shard-00004.tmp-killed").mkdir()  # what a killed run leaves behind
    kept = (out / "shard-00001" / "image.npy").stat().st_mtime_ns
    calls = []
    real = shards.embed_pairs

    def counting(model, pairs, *args, **kw):
        calls.append(pairs.records[0].key)
        return real(model, pairs, *args, **kw)

    monkeypatch.setattr(shards, "embed_pairs", counting)
    summary = embed_to_shards(_cfg(run, data, out))
    assert summary["written"] == 1 and summary["reused"] == 5
    assert calls == [load_pairs(data).records[3 * SHARD].key]  # only shard 3 was embedded again
    assert (out / "shard-00001" / "image.npy").stat().st_mtime_ns == kept
    assert not list(out.glob(".shard-*"))
    for a, b in zip(_union(single)[:2], _union(out)[:2]):
        np.testing.assert_array_equal(a, b)
    again = embed_to_shards(_cfg(run, data, out))  # nothing left to do
    assert again["written"] == 0 and len(calls) == 1


def test_vectors_are_the_importance_ordered_compact_embedding(run, data, single):
    model, _ = load_run(run)
    pairs = load_pairs(data)
    raw = embed_pairs(model, pairs, torch.device("cpu"), 64)  # (N, D) plain embeddings
    w = model.importance().detach()
    img, txt, meta = _union(single)
    for m in (4, 32):  # any top-m embedding is the re-normalised prefix of the stored vectors
        want = make_transform("importance", 32, m, w).with_signs_from(raw.image[:64])
        prefix = torch.nn.functional.normalize(torch.from_numpy(img[:, :m]), dim=-1)
        torch.testing.assert_close(prefix, want(raw.image), rtol=0, atol=1e-5)
        torch.testing.assert_close(
            torch.nn.functional.normalize(torch.from_numpy(txt[:, :m]), dim=-1), want(raw.text), rtol=0, atol=1e-5
        )
    assert (img[0] > 0).all()  # the sign fix: the first image is the anchor of every dimension
    manifest = read_manifest(single)
    assert manifest["importance"] == sorted(manifest["importance"], reverse=True)
    assert meta[0]["image"] == pairs.records[0].path and meta[0]["captions"] == pairs.records[0].captions


def test_float16_and_images_only(run, data, single, tmp_path):
    out = tmp_path / "half"
    summary = embed_to_shards(_cfg(run, data, out, dtype="float16", text=False))
    assert summary["text_count"] is None and summary["count"] == len(load_pairs(data).records)
    part = load_shard(out, 0)
    assert part["image"].dtype == np.float16 and part["text"] is None
    np.testing.assert_allclose(part["image"].astype(np.float32), load_shard(single, 0)["image"], atol=2e-3)


def test_refuses_a_folder_of_another_run(data, single, tmp_path):
    other = make_run(tmp_path / "other", seed=1)
    with pytest.raises(UserError, match="fingerprint"):
        embed_to_shards(_cfg(other, data, single))
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="not a triclip embeddings folder"):
        embed_to_shards(_cfg(other, data, tmp_path / "foreign"))


def test_cli_embed(run, data, tmp_path, capsys):
    out = tmp_path / "cli"
    argv = ["embed", "--run", str(run), "--data", str(data), "--out", str(out), "--shard-size", "40"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["shards"] == summary["finished"] == 3 and summary["count"] == len(load_pairs(data).records)
    assert main(argv[:-2] + ["--shard-size", "0"]) == 2
    assert "--shard-size must be >= 1" in capsys.readouterr().err


@pytest.mark.slow
def test_torchrun_two_processes(run, data, single, tmp_path):
    """The README's command: ``torchrun --nproc_per_node 2 -m triclip embed --run-dir ...``."""
    torchrun = Path(sys.executable).parent / "torchrun"
    out = tmp_path / "torchrun"
    cmd = [str(torchrun), "--nproc_per_node", "2", "--master_port", str(_free_port()), "-m", "triclip", "embed",
           "--run-dir", str(run), "--data", str(data), "--out", str(out), "--shard-size", str(SHARD)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=Path(__file__).parents[2], timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["world"] == 2
    for a, b in zip(_union(single)[:2], _union(out)[:2]):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    assert [r["id"] for r in _union(out)[2]] == [r["id"] for r in _union(single)[2]]


def test_locked_towers_reuse_the_cached_tower_outputs(data, tmp_path, monkeypatch):
    import triclip.model.embed
    from triclip.model.cache import locked_tower_outputs

    monkeypatch.setenv("TRICLIP_CACHE", str(tmp_path / "cache"))
    run = make_run(tmp_path / "locked", seed=2)
    config = json.loads((run / "config.json").read_text())
    config["train"] = {"lock_image": True, "lock_text": True}
    (run / "config.json").write_text(json.dumps(config))
    towers = embed_to_shards(_cfg(run, data, tmp_path / "towers"))  # no cache yet: the towers run
    model, _ = load_run(run)
    locked_tower_outputs(model, load_pairs(data), torch.device("cpu"))  # what training writes

    def no_tower(*args, **kw):
        raise AssertionError("the tower ran although its outputs were cached")

    monkeypatch.setattr(triclip.model.embed, "embed_records", no_tower)
    monkeypatch.setattr(triclip.model.embed, "embed_texts", no_tower)
    cached = embed_to_shards(_cfg(run, data, tmp_path / "cached"))
    assert cached["count"] == towers["count"] and cached["text_count"] == towers["text_count"]
    for a, b in zip(_union(tmp_path / "towers"), _union(tmp_path / "cached")):
        if isinstance(a, np.ndarray):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
        else:
            assert a == b
