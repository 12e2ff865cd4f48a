"""The third hostile trial (issue 28, "Nothing lost"): what it found, as tests that failed before the fix.

One mechanism carries most of it (``retrieval.io.writing``): every writer claims its folder,
takes its lock, writes its mark first and "done" last, and builds a replacement beside the
old folder. The full matrix (every writer x kill -9 at three points x rerun, and a 5 MB disk)
is ``scripts/kill_matrix.py`` (slow).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest


from tests.hostile.conftest import copy_tree, one_line_error
from tests.hostile.test_output_dirs import snapshot


# ---------------------------------------------------------------------------- item 2: a read never deletes


def test_a_read_never_deletes_a_complete_version(cli, tmp_path, built_index, shapes, tiny_run):
    from index.search import Searcher
    from index.store import _versions

    index = copy_tree(built_index, tmp_path / "index")
    status, _, err = cli("index", "build", "--run", tiny_run, "--data", shapes / "val.jsonl", "--out", index,
                         "--overwrite", "--dims", "8")  # fmt: skip
    assert status == 0, err
    assert _versions(index) == ["v000001", "v000002"]
    (index / "CURRENT").write_text("v000001\n")  # the user points back at the older complete version
    before = snapshot(index)
    searcher = Searcher.load(index)
    assert searcher.contents.version == "v000001"
    assert snapshot(index) == before  # v000002 is still there, untouched
