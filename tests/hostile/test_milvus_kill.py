"""``triclip index export`` killed mid-way (SIGKILL, on an event), then run again: the collection it would have
written uninterrupted, counted and compared row by row.

The index is built from random shards in ``triclip embed``'s format (``benchmarks/bench_milvus.py``:
3,000 images and 3,000 captions, D = 32) so that the export takes several chunks and seconds; the child
is killed when its progress line reports rows written, not after a delay.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks.bench_milvus import write_shards
from triclip.index import milvus as mv
from triclip.index.config import ExportConfig
from triclip.index.milvus_export import count_rows, export
from triclip.index.sources import IndexBuildConfig, build_index

ROWS = 3000


@pytest.fixture(scope="module")
def random_index(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("milvus_kill")
    emb = write_shards(root / "emb", ROWS, 32, shard_size=1000)
    build_index(IndexBuildConfig(embeddings=str(emb), out=str(root / "index"), factory="Flat"))
    return root / "index"


def rows_of(db: str) -> dict:
    """Every row of both collections: primary key -> (fields..., vector rounded)."""
    client = mv.connect(db)
    try:
        out = {}
        for name in ("triclip", "triclip_captions"):
            client.load_collection(name)
            got = client.query(name, filter="row >= 0", output_fields=["*"], limit=16384)
            out[name] = {r["row"]: tuple((k, np.round(np.asarray(v), 6).tolist() if k == "vector" else v)
                                         for k, v in sorted(r.items())) for r in got}
        out["props"] = mv.read_properties(client, "triclip")
        return out
    finally:
        mv.close(client)


def test_a_killed_export_runs_again_to_the_same_collection(random_index, tmp_path):
    for chunk in (10, 2):  # a progress line comes at most once a second: smaller chunks when 10 left none mid-way
        db = str(tmp_path / f"killed-{chunk}.db")
        if _killed_mid_way(random_index, db, chunk):
            break
    client = mv.connect(db)
    try:
        props = mv.read_properties(client, "triclip")
    finally:
        mv.close(client)
    done = int(props["done"])
    assert 0 < done < ROWS and done % chunk == 0 and props["complete"] == ""  # a watermark mid-way, chunk by chunk

    resumed = export(ExportConfig(index=str(random_index), to=db, chunk=chunk))
    assert resumed["resumed_from"] == done and resumed["rows_written"] == ROWS - done
    whole = str(tmp_path / "whole.db")
    export(ExportConfig(index=str(random_index), to=whole, chunk=chunk))
    after_kill, uninterrupted = rows_of(db), rows_of(whole)
    for name in ("triclip", "triclip_captions"):
        assert len(after_kill[name]) == ROWS
        assert after_kill[name] == uninterrupted[name], name
    assert after_kill["props"]["complete"] == uninterrupted["props"]["complete"] != ""
    assert after_kill["props"]["ids_sha256"] == uninterrupted["props"]["ids_sha256"]


def _killed_mid_way(index: Path, db: str, chunk: int) -> bool:
    """``index export`` in a child, SIGKILLed at its first progress line with rows still to send; False when
    none came before the rows were all sent (the child is killed then too)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    child = subprocess.Popen([sys.executable, "-m", "triclip", "index", "export", "--index", str(index), "--to", db,
                              "--chunk", str(chunk)], env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    seen, mid_way = [], False
    try:
        for line in child.stderr:  # the progress lines: "export to triclip: 350/3000 image (12%), ..."
            seen.append(line)
            sent = re.search(r"export to triclip: (\d+)/", line)
            if sent:
                mid_way = 0 < int(sent.group(1)) < ROWS
                child.send_signal(signal.SIGKILL)
                break
    finally:
        child.kill()
        child.wait(timeout=60)
    assert child.returncode == -signal.SIGKILL, "".join(seen)  # killed, not finished
    return mid_way


def test_an_export_killed_after_its_rows_finishes_its_index_on_the_next_run(random_index, tmp_path):
    """Killed while it builds the Milvus index (after the last progress line): the rerun writes no row and
    the collection loads and counts right."""
    db = str(tmp_path / "t.db")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    child = subprocess.Popen([sys.executable, "-m", "triclip", "index", "export", "--index", str(random_index), "--to", db,
                              "--chunk", "500", "--no-text"], env=env, stderr=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)  # fmt: skip
    try:
        for line in child.stderr:
            if f"export to triclip: {ROWS}/{ROWS}" in line:  # the last line: every row is in, the index comes next
                child.send_signal(signal.SIGKILL)
                break
    finally:
        child.kill()
        child.wait(timeout=60)
    assert child.returncode == -signal.SIGKILL
    again = export(ExportConfig(index=str(random_index), to=db, chunk=500, text=False))
    assert again["rows_written"] == 0 and again["resumed_from"] == ROWS
    client = mv.connect(db)
    try:
        client.load_collection("triclip")
        assert count_rows(client, "triclip") == ROWS
        assert mv.read_properties(client, "triclip")["complete"].startswith("v000001:")
    finally:
        mv.close(client)


def test_a_chunked_export_answers_like_the_flat_index(random_index, tmp_path):
    """A collection written in chunks serves the local Flat index's top 10 (queried by stored vectors)."""
    from triclip.index.store import load_contents
    from triclip.index.vectors import prefix

    db = str(tmp_path / "t.db")
    export(ExportConfig(index=str(random_index), to=db, chunk=1000, text=False))
    contents = load_contents(random_index, indexes=False)
    client = mv.connect(db)
    try:
        client.load_collection("triclip")
        queries = prefix(np.asarray(contents.vectors[:20]), 32)
        got = client.search("triclip", data=queries.tolist(), limit=10, anns_field="vector",
                            search_params={"metric_type": "IP"}, output_fields=["id"])
        exact = np.argsort(-(queries @ np.asarray(contents.vectors).T), axis=1)[:, :10]
        assert [[h["row"] for h in q] for q in got] == exact.tolist()
        assert json.loads(mv.read_properties(client, "triclip")["plan"])[0]["index_type"] == "FLAT"
    finally:
        mv.close(client)
