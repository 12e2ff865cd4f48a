"""The app's image files over meta rows read when asked, against the same files over the list of rows."""

from __future__ import annotations

import os

import numpy as np

from triclip.app.live import ImageFiles
from triclip.index import metafile
from triclip.index.manifest import file_identity


def test_lazy_image_files_equal_the_listed_ones(tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    os.symlink(images, tmp_path / "link")  # a folder reached through a link: resolved, as at load
    rows = []
    for i in range(12):
        path = images / f"{i}.png"
        path.write_bytes(b"\x89PNG" + bytes([i]) * (i + 1))
        rows.append({"id": f"r{i}", "image": str(tmp_path / "link" / path.name), "captions": [], "file": file_identity(path)})
    rows[3]["image"] = "relative.png"  # never served
    rows[5]["file"] = None  # recorded as not a regular file
    (images / "7.png").write_bytes(b"changed")  # not the file that was indexed
    metafile.write_meta(tmp_path, "meta.jsonl", rows)
    arrays = {name: np.load(tmp_path / name, mmap_mode="r") for name in metafile.FILES}
    lazy = ImageFiles.of(metafile.open_meta(tmp_path, "meta.jsonl", len(rows), arrays, ValueError))
    listed = ImageFiles.of(rows)
    assert [lazy.paths[i] for i in range(12)] == listed.paths and [lazy.identity[i] for i in range(12)] == listed.identity
    assert [lazy.read(i) for i in range(-1, 13)] == [listed.read(i) for i in range(-1, 13)]
    assert lazy.read(2)[0] == b"\x89PNG" + bytes([2]) * 3 and lazy.read(7)[0] is None and lazy.read(3)[0] is None
