"""Damage is detected, not reused.

Embedding shards record each file's size and sha256 (``shard.json``): ``embed`` recomputes a
truncated, re-typed or (with ``--verify``) bit-flipped shard instead of reporting it
reused, and ``index build --embeddings`` refuses a damaged one with one line, never a
traceback. Weights files carry a size and sha256 record checked on loading: flipped bytes
of the same size are refused. Runs and shards written before the records keep working.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from triclip.model.shards import IMAGE, SHARD_INFO, TEXT, shard_name
from tests.hostile.conftest import copy_tree, one_line_error


@pytest.fixture(scope="module")
def shards(tmp_path_factory, shapes, tiny_run) -> Path:
    """An embeddings folder of the shapes train split in shards of 16."""
    from triclip.model.shards import EmbedConfig, embed_to_shards

    out = tmp_path_factory.mktemp("damage") / "emb"
    embed_to_shards(EmbedConfig(run=str(tiny_run), data=str(shapes / "train.jsonl"), out=str(out), shard_size=16))
    return out


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def object_dtype(path: Path) -> None:
    arr = np.load(path)
    np.save(path, np.array([row for row in arr] + [None], dtype=object), allow_pickle=True)


def flip_bytes(path: Path) -> None:
    """Same size, a few bytes changed in the data (the tail of the file)."""
    data = bytearray(path.read_bytes())
    for i in range(len(data) - 40, len(data) - 8, 4):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGE = {"truncated": truncate, "object dtype": object_dtype}


@pytest.mark.parametrize("kind", list(DAMAGE))
@pytest.mark.parametrize("name", [IMAGE, TEXT])
def test_embed_recomputes_a_damaged_shard(cli, tmp_path, shards, shapes, tiny_run, kind, name):
    emb = copy_tree(shards, tmp_path / "emb")
    good = np.load(emb / shard_name(1) / name)
    DAMAGE[kind](emb / shard_name(1) / name)
    status, out, err = cli("embed", "--run", tiny_run, "--data", shapes / "train.jsonl", "--out", emb,
                           "--shard-size", 16)  # fmt: skip
    assert status == 0, err
    summary = json.loads(out)
    assert summary["written"] == 1 and summary["reused"] == summary["shards"] - 1
    assert f"{shard_name(1)} is damaged" in err
    np.testing.assert_array_equal(np.load(emb / shard_name(1) / name, allow_pickle=False), good)


def test_embed_verify_catches_flipped_bytes_of_the_same_size(cli, tmp_path, shards, shapes, tiny_run):
    emb = copy_tree(shards, tmp_path / "emb")
    good = np.load(emb / shard_name(0) / IMAGE)
    flip_bytes(emb / shard_name(0) / IMAGE)
    args = ["embed", "--run", tiny_run, "--data", shapes / "train.jsonl", "--out", emb, "--shard-size", 16]
    status, out, _ = cli(*args)  # sizes only: the flip is not seen (the hash is read on request)
    assert status == 0 and json.loads(out)["written"] == 0
    status, out, err = cli(*args, "--verify")
    assert status == 0 and json.loads(out)["written"] == 1 and "sha256" in err
    np.testing.assert_array_equal(np.load(emb / shard_name(0) / IMAGE), good)


@pytest.mark.parametrize("kind", list(DAMAGE) + ["shard.json garbled", "file removed"])
def test_index_build_from_damaged_shards_is_one_line(cli, tmp_path, shards, kind):
    emb = copy_tree(shards, tmp_path / "emb")
    target = emb / shard_name(1) / IMAGE
    if kind == "shard.json garbled":
        (emb / shard_name(1) / SHARD_INFO).write_text("{not json")
    elif kind == "file removed":
        target.unlink()
    else:
        DAMAGE[kind](target)
    status, _, err = cli("index", "build", "--embeddings", emb, "--out", tmp_path / "index")
    line = one_line_error(status, err)
    assert shard_name(1) in line or "incomplete" in line
    assert not (tmp_path / "index").exists() or not any((tmp_path / "index").iterdir())


def test_shards_without_records_still_work(cli, tmp_path, shards, shapes, tiny_run):
    """Shards written before sizes were recorded: header checks only, reused when whole."""
    emb = copy_tree(shards, tmp_path / "emb")
    for info_path in emb.glob("shard-*/" + SHARD_INFO):
        info = json.loads(info_path.read_text())
        info.pop("files")
        info_path.write_text(json.dumps(info))
    status, out, err = cli("embed", "--run", tiny_run, "--data", shapes / "train.jsonl", "--out", emb,
                           "--shard-size", 16)  # fmt: skip
    assert status == 0 and json.loads(out)["written"] == 0, err
    truncate(emb / shard_name(2) / IMAGE)
    status, _, err = cli("index", "build", "--embeddings", emb, "--out", tmp_path / "index")
    assert "truncated" in one_line_error(status, err)
    shutil.rmtree(tmp_path / "index", ignore_errors=True)


# ---------------------------------------------------------------------------- weights


def test_weights_with_flipped_bytes_of_the_same_size_are_refused(cli, tmp_path, tiny_run, shapes):
    from triclip.core.errors import UserError
    from triclip.model.run import load_run

    run = copy_tree(tiny_run, tmp_path / "run")
    load_run(run)  # whole: loads
    size = (run / "model.safetensors").stat().st_size
    flip_bytes(run / "model.safetensors")
    assert (run / "model.safetensors").stat().st_size == size
    with pytest.raises(UserError, match="sha256"):
        load_run(run)
    status, _, err = cli("eval", "--run", run, "--data", shapes / "val.jsonl", "--json")
    assert "sha256" in one_line_error(status, err)


def test_weights_without_a_record_still_load(tmp_path, tiny_run):
    """A run written before the record (plain safetensors, no metadata) loads unchecked."""
    from safetensors.torch import load_file, save_file

    from triclip.model.run import load_run

    run = copy_tree(tiny_run, tmp_path / "run")
    tensors = load_file(str(run / "model.safetensors"))
    save_file(tensors, str(run / "model.safetensors"))
    model, _ = load_run(run)
    assert all((model.state_dict()[k] == v).all() for k, v in tensors.items())


def test_resume_refuses_a_checkpoint_with_flipped_bytes(cli, tmp_path, shapes):
    run = tmp_path / "run"
    args = ["train", "--train-data", shapes / "train.jsonl", "--out", run, "--model", "tiny", "--loss", "infonce",
            "--epochs", "2", "--batch-size", "16", "--embed-dim", "16"]  # fmt: skip
    status, _, err = cli(*args, "--max-steps", "1")
    assert status == 0, err
    for name in ("model.safetensors", "optim.safetensors"):
        target = run / "checkpoint" / name
        if not target.exists():
            continue
        saved = target.read_bytes()
        target.unlink()  # a hard link to RUN/model.safetensors: damage this copy only
        target.write_bytes(saved)
        flip_bytes(target)
        status, _, err = cli(*args, "--resume")
        assert "--resume" in one_line_error(status, err)
        target.write_bytes(saved)
