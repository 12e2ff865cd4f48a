"""Bad Milvus URIs, an address that does not answer, a Milvus Lite file another process holds, a full disk:
one line, exit 2, within seconds, and nothing lost (a rerun finishes the export)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from tests.hostile.conftest import one_line_error, run_triclip
from triclip.index import milvus as mv
from triclip.index.config import ExportConfig
from triclip.index.milvus_export import count_rows, export


def test_an_address_nothing_listens_on_is_one_line_within_seconds(tmp_path, built_index):
    started = time.monotonic()
    proc = run_triclip(["index", "export", "--index", built_index, "--to", "http://127.0.0.1:1"], tmp_path, timeout=120)
    line = one_line_error(proc.returncode, proc.stderr)
    assert "cannot reach Milvus at http://127.0.0.1:1" in line
    assert time.monotonic() - started < 30  # interpreter start and imports included: never a hang


def test_an_address_that_never_answers_gives_up_after_the_timeout(tmp_path, built_index):
    with socket.socket() as silent:  # accepts connections (the kernel's backlog) and never speaks
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        uri = f"http://127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        for args in (["index", "export", "--index", built_index, "--to", uri, "--timeout", "2"],
                     ["search", "--index", uri, "--text", "a red circle"]):  # search: the default 10 s
            proc = run_triclip(args, tmp_path, timeout=120)
            line = one_line_error(proc.returncode, proc.stderr)
            assert f"cannot reach Milvus at {uri} within" in line, line
        assert time.monotonic() - started < 60


@pytest.mark.parametrize("uri, needle", [
    ("ftp://example/x", "not a Milvus URI"),
    ("relative/no/such/folder/x.db", "does not exist"),
    ("not-a-uri", "not a Milvus URI"),
])  # fmt: skip
def test_bad_uris_are_one_line(cli, built_index, uri, needle):
    status, _, err = cli("index", "export", "--index", built_index, "--to", uri)
    assert needle in one_line_error(status, err)


def test_a_db_that_is_a_file_or_a_foreign_folder_is_refused_and_left_alone(cli, tmp_path, built_index):
    (tmp_path / "file.db").write_text("mine")
    status, _, err = cli("index", "export", "--index", built_index, "--to", tmp_path / "file.db")
    assert "is a file" in one_line_error(status, err)
    (tmp_path / "folder.db").mkdir()
    (tmp_path / "folder.db" / "notes.txt").write_text("mine")
    status, _, err = cli("index", "export", "--index", built_index, "--to", tmp_path / "folder.db")
    assert "not Milvus Lite's" in one_line_error(status, err)
    assert (tmp_path / "file.db").read_text() == "mine" and os.listdir(tmp_path / "folder.db") == ["notes.txt"]


def test_a_lite_file_held_by_another_process_is_one_line(cli, tmp_path, built_index):
    db = tmp_path / "held.db"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom pymilvus import MilvusClient\nMilvusClient(sys.argv[1])\n"
         "print('ready', flush=True)\ntime.sleep(120)", str(db)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        text=True)  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "ready"
        for args in (["index", "export", "--index", built_index, "--to", db], ["search", "--index", db, "--text", "x"]):
            status, _, err = cli(*args)
            assert "open in another process" in one_line_error(status, err)
    finally:
        holder.kill()
        holder.wait()
    status, out, err = cli("index", "export", "--index", built_index, "--to", db)  # free again
    assert status == 0, err


def test_a_collection_written_by_someone_else_is_refused(cli, tmp_path, built_index):
    db = str(tmp_path / "t.db")
    client = mv.connect(db)
    try:
        client.create_collection("triclip", dimension=8)
    finally:
        mv.close(client)
    status, _, err = cli("index", "export", "--index", built_index, "--to", db)
    assert "was not written by triclip index export" in one_line_error(status, err)
    status, _, err = cli("search", "--index", db, "--text", "a red circle")
    assert "holds no collection written by triclip" in one_line_error(status, err)


@pytest.mark.parametrize("leave", [8 << 10, 64 << 10])
def test_a_full_disk_is_one_line_and_a_rerun_finishes(cli, built_index, small_disk, leave):
    disk = small_disk(leave=leave)
    db = disk / "t.db"
    status, _, err = cli("index", "export", "--index", built_index, "--to", db, "--chunk", "5")
    line = one_line_error(status, err)
    assert "No space left on device" in line or "disk full" in line, line
    (disk / "filler").unlink()
    status, out, err = cli("index", "export", "--index", built_index, "--to", db, "--chunk", "5")
    assert status == 0, err
    summary = export(ExportConfig(index=str(built_index), to=str(db)))  # a third run: nothing left to write
    assert summary["rows_written"] == 0
    client = mv.connect(str(db))
    try:
        client.load_collection("triclip")
        assert count_rows(client, "triclip") == summary["count"]
    finally:
        mv.close(client)
