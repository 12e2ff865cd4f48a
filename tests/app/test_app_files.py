"""The image route serves only what was indexed, on a real server on 127.0.0.1.

An indexed image replaced by a link (to /etc/passwd), by other bytes, by a FIFO, or
reached through a folder swapped for a link, is a 404 and one log line, on the app's
own route and through Gradio's ``/gradio_api/file=`` route; an index built before file
identities were recorded falls back to the identity found at load, and says so.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import httpx
import pytest

from tests.app.conftest import serving, small_index

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def index(tmp_path):
    return small_index(tmp_path, num=30)


def _meta(index):
    from triclip.index.store import load_contents

    return load_contents(index).meta


def _get(url: str) -> httpx.Response:
    return httpx.get(url, timeout=30)


def test_build_records_each_image_files_identity(index):
    meta = _meta(index)
    st = os.lstat(meta[0]["image"])
    assert meta[0]["file"] == [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]
    assert all(isinstance(row["file"], list) for row in meta)


def test_a_replaced_image_is_not_served(index, caplog):
    meta = _meta(index)
    caplog.set_level(logging.WARNING, logger="triclip.app")
    with serving(index) as (url, app):
        version = app.live.view().version
        assert _get(f"{url}triclip/image/1").content[:8] == PNG  # served while untouched
        link, rewritten, fifo = meta[1]["image"], meta[2]["image"], meta[3]["image"]
        os.unlink(link)
        os.symlink("/etc/passwd", link)  # the attack: a link out of the indexed folder
        with open(rewritten, "ab") as fh:  # other bytes under the indexed name
            fh.write(b"more")
        os.unlink(fifo)
        os.mkfifo(fifo)  # opening it must not hang the route
        caplog.clear()
        for row in (1, 2, 3):
            for path in (f"triclip/image/{row}", f"triclip/image/{row}?v={version}",
                         f"gradio_api/file={url}triclip/image/{row}"):
                answer = _get(url + path)
                assert answer.status_code == 404, path
                assert b"root:" not in answer.content
        refused = [r.getMessage() for r in caplog.records if r.name == "triclip.app"]
        assert len(refused) == 9 and all("refused row" in line and "\n" not in line for line in refused)
        assert "without following links" in refused[0] and "not the file that was indexed" in refused[3]
        assert _get(f"{url}triclip/image/0").content[:8] == PNG  # the others still are
        for path in ("/etc/passwd", meta[0]["image"], link):  # Gradio's file route serves no path of ours
            assert _get(f"{url}gradio_api/file={path}").status_code in (403, 404), path


def test_a_folder_swapped_for_a_link_is_not_served(index):
    meta = _meta(index)
    folder = os.path.dirname(meta[0]["image"])
    with serving(index) as (url, _):
        assert _get(f"{url}triclip/image/0").status_code == 200
        shutil.copytree(folder, folder + "-copy")  # the same names and bytes, other files
        shutil.rmtree(folder)
        os.symlink(folder + "-copy", folder)
        assert _get(f"{url}triclip/image/0").status_code == 404


def test_an_index_without_identities_uses_the_ones_found_at_load(index, caplog):
    from triclip.index import metafile
    from triclip.index.store import META, current_version

    meta_file = index / current_version(index) / META
    rows = [json.loads(line) for line in meta_file.read_text().splitlines()]
    meta_file.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "file"}) + "\n" for r in rows))
    manifest = json.loads((meta_file.parent / "manifest.json").read_text())
    manifest.pop("files")  # an index that old records neither identities nor its files
    for name in metafile.FILES:  # nor has the offset and id files of its meta rows
        (meta_file.parent / name).unlink()
    (meta_file.parent / "manifest.json").write_text(json.dumps(manifest))
    caplog.set_level(logging.WARNING, logger="triclip.app")
    with serving(index) as (url, _):
        assert any(f"records no file identities for {len(rows)} images" in r.getMessage() for r in caplog.records)
        assert any("records no size or fingerprint of its files" in r.getMessage() for r in caplog.records)
        assert _get(f"{url}triclip/image/4").content[:8] == PNG
        os.unlink(rows[4]["image"])
        os.symlink("/etc/passwd", rows[4]["image"])
        assert _get(f"{url}triclip/image/4").status_code == 404


def test_a_client_gets_the_other_results_when_one_image_changed(index, caplog, tmp_path):
    """A default gradio_client (it fetches every result) raised 404 on the row whose file
    was replaced, and got no results at all; now that row is left out of the answer, and logged."""
    from gradio_client import Client

    from triclip.index.search import Searcher

    query = "two red circles"
    top = Searcher.load(index).search_text([query], k=5, m=None)[0]
    changed = top[0]["image"]
    caplog.set_level(logging.WARNING, logger="triclip.app")
    with serving(index) as (url, _app):
        with open(changed, "ab") as fh:  # the best hit's file replaced after indexing
            fh.write(b"more")
        client = Client(url, verbose=False, download_files=str(tmp_path / "got"))
        gallery, status = client.predict(query, None, False, 5, api_name="/search_text")
        assert len(gallery) == 4 and "1 result left out: its file changed since indexing" in status
        for item in gallery:
            with open(item["image"], "rb") as fh:
                assert fh.read(8) == PNG
        answer = _get(f"{url}triclip/api/search_text?q={query}&k=5").json()
        assert answer["left_out"] == 1 and top[0]["id"] not in {h["id"] for h in answer["hits"]}
        assert [h["id"] for h in answer["hits"]] == [h["id"] for h in top[1:]]
    assert any("left result" in r.getMessage() and changed in r.getMessage() for r in caplog.records)
