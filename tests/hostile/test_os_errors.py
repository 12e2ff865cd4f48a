"""Every OS error is one line (exit 2, no traceback), found before the work.

Permissions are tested in a child process that cannot override them (see
``conftest.unprivileged_prefix``: we run as root, which ignores chmod). A closed pipe
(``search --json | head``) ends quietly. ``--out`` that is a device or a FIFO, a
``TRICLIP_CACHE`` that is a file, absurd sizes, a duplicate CSV column and an offline
``--pretrained`` are refused before anything is computed.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.hostile.conftest import copy_tree, one_line_error, run_triclip


def one_line_child(proc: subprocess.CompletedProcess) -> str:
    """The CompletedProcess of a refused command: exit 2, one ``triclip: error:`` line, no traceback."""
    return one_line_error(proc.returncode, proc.stderr)


# ---------------------------------------------------------------------------- permissions (child processes)


def test_out_under_an_unwritable_parent_is_one_line(tmp_path):
    parent = tmp_path / "locked"
    parent.mkdir()
    os.chmod(parent, 0)
    try:
        proc = run_triclip(["data", "prepare", "shapes", "--out", parent / "data", "--num", 10], tmp_path, unprivileged=True)
    finally:
        os.chmod(parent, 0o700)
    assert "locked" in one_line_child(proc)
    assert not (parent / "data").exists()


def test_unreadable_data_is_one_line(tmp_path, shapes):
    data = copy_tree(shapes, tmp_path / "data")
    os.chmod(data / "train.jsonl", 0)
    proc = run_triclip(["data", "inspect", data / "train.jsonl", "--json"], tmp_path, unprivileged=True)
    assert "train.jsonl" in one_line_child(proc)


@pytest.mark.slow
def test_add_into_an_index_one_cannot_write_is_refused_before_embedding(tmp_path, built_index, shapes, tiny_run):
    index = copy_tree(built_index, tmp_path / "index")
    os.chmod(index, 0o555)
    try:
        proc = run_triclip(["index", "build", "--run", tiny_run, "--data", shapes / "val.jsonl", "--out", index, "--add"],
                           tmp_path, unprivileged=True)  # fmt: skip
    finally:
        os.chmod(index, 0o755)
    assert "cannot write" in one_line_child(proc)
    assert "embedding" not in proc.stderr  # refused before the model ran


@pytest.mark.slow
@pytest.mark.parametrize("what", ["run", "index", "shards"])
def test_unreadable_run_index_or_shards_is_one_line(tmp_path, built_index, shapes, tiny_run, what):
    if what == "run":
        run = copy_tree(tiny_run, tmp_path / "run")
        os.chmod(run / "model.safetensors", 0)
        args = ["eval", "--run", run, "--data", shapes / "val.jsonl", "--json"]
    elif what == "index":
        index = copy_tree(built_index, tmp_path / "index")
        version = (index / "CURRENT").read_text().strip()
        os.chmod(index / version / "vectors.npy", 0)
        args = ["search", "--index", index, "--text", "red", "--json"]
    else:
        from triclip.model.shards import EmbedConfig, embed_to_shards

        emb = tmp_path / "emb"
        embed_to_shards(EmbedConfig(run=str(tiny_run), data=str(shapes / "val.jsonl"), out=str(emb)))
        os.chmod(emb / "shard-00000" / "image.npy", 0)
        args = ["index", "build", "--embeddings", emb, "--out", tmp_path / "built"]
    proc = run_triclip(args, tmp_path, unprivileged=True)
    one_line_child(proc)


# ---------------------------------------------------------------------------- a reader that goes away


@pytest.mark.parametrize("command", ["search", pytest.param("eval", marks=pytest.mark.slow)])
def test_a_closed_pipe_ends_quietly(tmp_path, built_index, shapes, tiny_run, command):
    args = {
        "search": ["search", "--index", built_index, "--text", "red", "--text", "blue", "-k", 40, "--json"],
        "eval": ["eval", "--run", tiny_run, "--data", shapes / "val.jsonl", "--json"],
    }[command]
    read, write = os.pipe()
    os.close(read)  # like `| head` that has already exited: every write raises EPIPE
    try:
        proc = run_triclip(args, tmp_path, stdout=write)
    finally:
        os.close(write)
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr
    assert "Exception ignored" not in proc.stderr
    assert proc.returncode in (0, 1)


def test_an_os_error_anywhere_is_one_line(cli, monkeypatch, tmp_path):
    import triclip.data

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(tmp_path / "secret.jsonl"))

    monkeypatch.setattr(triclip.data, "inspect", denied)
    (tmp_path / "secret.jsonl").write_text("")  # there (the command checks that first), then unreadable while read
    status, _, err = cli("data", "inspect", tmp_path / "secret.jsonl", "--json")
    assert one_line_error(status, err).endswith("secret.jsonl: Permission denied")


# ---------------------------------------------------------------------------- validated before the work


@pytest.fixture
def no_embedding(monkeypatch):
    """Fail the test if anything is embedded."""
    import triclip.index.sources
    import triclip.model.shards

    def embed(*args, **kwargs):
        raise AssertionError("embedded before refusing the output")

    monkeypatch.setattr(triclip.model.shards, "embed_pairs", embed)
    monkeypatch.setattr(triclip.index.sources, "embed_pairs", embed)


@pytest.mark.parametrize("target", ["/dev/null", "fifo"])
@pytest.mark.parametrize("command", ["index", "embed"])
def test_out_that_is_a_device_or_fifo_is_refused_first(cli, tmp_path, shapes, tiny_run, no_embedding, target, command):
    if target == "fifo":
        target = tmp_path / "fifo"
        os.mkfifo(target)
    if command == "index":
        args = ["index", "build", "--run", tiny_run, "--data", shapes / "val.jsonl", "--out", target]
    else:
        args = ["embed", "--run", tiny_run, "--data", shapes / "val.jsonl", "--out", target]
    status, _, err = cli(*args)
    assert "not a folder" in one_line_error(status, err)


def test_triclip_cache_that_is_a_file_is_one_line(cli, tmp_path, shapes, monkeypatch):
    (tmp_path / "cachefile").write_text("not a folder")
    monkeypatch.setenv("TRICLIP_CACHE", str(tmp_path / "cachefile"))
    status, _, err = cli("train", "--train-data", shapes / "train.jsonl", "--out", tmp_path / "run", "--model", "tiny",
                         "--loss", "infonce", "--epochs", 1, "--batch-size", 16, "--lock-image", "--lock-text")  # fmt: skip
    assert "TRICLIP_CACHE" in one_line_error(status, err)
    assert (tmp_path / "cachefile").read_text() == "not a folder"


@pytest.mark.parametrize("value", ["99999999", "0", "-3"])
def test_absurd_embed_dim_is_refused(cli, tmp_path, shapes, value):
    status, _, err = cli("train", "--train-data", shapes / "train.jsonl", "--out", tmp_path / "run", "--model", "tiny",
                         "--loss", "infonce", "--epochs", 1, "--embed-dim", value)  # fmt: skip
    assert "--embed-dim" in one_line_error(status, err)


def test_data_prepare_checks_the_space_it_needs(cli, tmp_path):
    status, _, err = cli("data", "prepare", "shapes", "--out", tmp_path / "huge", "--num", 10**12)
    assert "free" in one_line_error(status, err)
    assert not (tmp_path / "huge").exists()


def test_duplicate_csv_column_is_refused(cli, tmp_path, shapes):
    rows = [json.loads(line) for line in (shapes / "val.jsonl").read_text().splitlines()]
    lines = ["filepath,title,title"] + [f"{shapes / r['image']},{r['captions'][0]},other" for r in rows]
    (tmp_path / "pairs.csv").write_text("\n".join(lines) + "\n")
    status, _, err = cli("data", "inspect", tmp_path / "pairs.csv", "--json")
    assert "'title' 2 times" in one_line_error(status, err)


def test_offline_pretrained_says_it_once(cli, tmp_path, shapes, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    status, _, err = cli("train", "--train-data", shapes / "train.jsonl", "--out", tmp_path / "run", "--model", "RN50",
                         "--pretrained", "openai", "--loss", "infonce", "--epochs", 1)  # fmt: skip
    assert "pretrained" in one_line_error(status, err)
    assert "ERROR:root" not in err and len([line for line in err.splitlines() if line.strip()]) == 1, err
