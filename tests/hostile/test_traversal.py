"""Path traversal outside the app: names read from index and shard files never leave their folder.

The app's routes (``/triclip/image/<row>``, ``/gradio_api/file=``) are tested in
tests/app/test_app_files.py and tests/app/test_app.py. Here: a ``CURRENT`` pointer, an
``on_disk`` lists name and a shard's file record that point outside are not followed.
"""

from __future__ import annotations

import json

import pytest

from triclip.index.store import MANIFEST, current_version, load_contents
from tests.hostile.conftest import copy_tree, one_line_error


@pytest.mark.parametrize("pointer", ["../other/{own}", "{other}/{own}", "{own}/../../other/{own}", "..", "CURRENT"])
def test_a_current_pointer_outside_the_index_is_not_followed(tmp_path, built_index, pointer):
    index = copy_tree(built_index, tmp_path / "index")
    own = current_version(index)
    other = copy_tree(built_index, tmp_path / "other")  # a whole version, one folder up
    manifest = json.loads((other / own / MANIFEST).read_text())
    manifest["run"] = "ELSEWHERE"
    (other / own / MANIFEST).write_text(json.dumps(manifest))
    (index / "CURRENT").write_text(pointer.format(own=own, other=other) + "\n")
    contents = load_contents(index, indexes=False)
    assert contents.version == own and contents.manifest["run"] != "ELSEWHERE"


def test_an_on_disk_lists_name_outside_the_version_is_refused(cli, tmp_path, built_index):
    index = copy_tree(built_index, tmp_path / "index")
    version = index / current_version(index)
    manifest = json.loads((version / MANIFEST).read_text())
    (tmp_path / "secret.ivfdata").write_bytes(b"x" * 64)
    manifest["on_disk"] = {"image": {"8": "../../secret.ivfdata"}}
    (version / MANIFEST).write_text(json.dumps(manifest))
    status, _, err = cli("search", "--index", index, "--text", "red", "--json")
    assert "on_disk" in one_line_error(status, err)


def test_a_shard_record_outside_the_shard_is_refused(cli, tmp_path, shapes, tiny_run):
    from triclip.model.shards import SHARD_INFO, EmbedConfig, embed_to_shards, shard_name

    emb = tmp_path / "emb"
    embed_to_shards(EmbedConfig(run=str(tiny_run), data=str(shapes / "val.jsonl"), out=str(emb)))
    info_path = emb / shard_name(0) / SHARD_INFO
    info = json.loads(info_path.read_text())
    info["files"]["../../manifest.json"] = {"size": 1, "sha256": "0" * 64}
    info_path.write_text(json.dumps(info))
    status, _, err = cli("index", "build", "--embeddings", emb, "--out", tmp_path / "index")
    assert "outside the shard" in one_line_error(status, err)
