"""Meta rows streamed from the shards (triclip.index.metarows) against the list they replace."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from triclip.core.errors import UserError
from triclip.core.io import file_sha256
from triclip.index import metarows
from triclip.index.manifest import unique_ids
from triclip.index.metarows import MetaRows
from triclip.index.sources import IndexBuildConfig, build_index
from triclip.index.store import META, load_contents
from triclip.model.shards import EmbedConfig, embed_to_shards, load_shard


def _write_shards(folder: Path, shards: list[list[dict]]) -> MetaRows:
    files = []
    for s, rows in enumerate(shards):
        files.append(folder / f"meta{s}.jsonl")
        files[-1].write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return MetaRows(files, [len(rows) for rows in shards])


def _rows(ids: list) -> list[dict]:
    return [{"id": rid, "image": f"img{i}.png", "captions": [f"c{i}"], "label": None} for i, rid in enumerate(ids)]


@pytest.mark.parametrize("seed", range(12))
def test_streamed_rows_equal_unique_ids_of_the_whole_list(tmp_path, seed):
    rng = np.random.default_rng(seed)
    names = ["a", "b", "a#2", "a#3", "b#2", "a#2#2", "c", "a#4"]  # renamed ids that collide with written ones
    ids = [names[k] for k in rng.integers(0, len(names), size=int(rng.integers(1, 40)))]
    rows = _rows(ids)
    cuts = np.sort(rng.integers(0, len(rows) + 1, size=3))
    shards = [rows[a:b] for a, b in zip([0, *cuts], [*cuts, len(rows)])]  # some shards may be empty
    streamed = _write_shards(tmp_path, shards)
    want = unique_ids(copy.deepcopy(rows))
    assert len(streamed) == len(want)
    assert list(streamed) == want
    assert [streamed[i] for i in range(len(want))] == want and streamed[-1] == want[-1]
    assert streamed[1:7:2] == want[1:7:2]


def test_known_cases_of_unique_ids(tmp_path):
    for ids, want in ((["a", "a", "a#2"], ["a", "a#2", "a#2#2"]),  # a later written id the rename took
                      (["a#2", "a", "a"], ["a#2", "a", "a#3"]),  # an earlier written id the rename skips
                      (["x", "y", "z"], ["x", "y", "z"])):
        folder = tmp_path / "_".join(ids)
        folder.mkdir()
        streamed = _write_shards(folder, [_rows(ids)[:1], _rows(ids)[1:]])
        assert [r["id"] for r in streamed] == want == [r["id"] for r in unique_ids(_rows(ids))]


def test_unique_ids_read_only_hashes_and_renames_are_kept_for_a_resume(tmp_path, monkeypatch):
    streamed = _write_shards(tmp_path, [_rows(["p", "q"]), _rows(["p", "r"])])
    streamed.kept = tmp_path / metarows.RENAMES
    assert [r["id"] for r in streamed] == ["p", "q", "p#2", "r"]
    assert json.loads(streamed.kept.read_text()) == [[2, "p#2"]]
    monkeypatch.setattr(metarows, "unique_renames", lambda rows: pytest.fail("found again, not read back"))
    again = MetaRows(streamed.files, [2, 2], kept=streamed.kept)
    assert again[2]["id"] == "p#2" and len(again) == 4
    monkeypatch.undo()
    (tmp_path / "u").mkdir()
    unique = _write_shards(tmp_path / "u", [_rows(["s", "t"]), _rows(["u"])])
    monkeypatch.setattr(unique, "ids_of", lambda rows: pytest.fail("strings read with no repeated hash"))
    assert unique.renames == {} and [r["id"] for r in unique] == ["s", "t", "u"]


def test_the_id_read_alone_is_the_id_of_the_whole_line():
    rows = [{"id": 'q"uote\\ \u00e9\u6f22 \U0001f600', "image": "x"}, {"image": "x", "id": "later"}, {"id": 7, "n": 1},
            {"id": "a", "captions": ["{\"id\": \"b\"}"]}]
    for row in rows:
        for line in (json.dumps(row), json.dumps(row, ensure_ascii=False)):
            assert metarows.line_id(line + "\n") == json.loads(line)["id"] == row["id"]


def test_a_meta_file_that_disagrees_with_its_count_is_one_line(tmp_path):
    streamed = _write_shards(tmp_path, [_rows(["a", "b"])])
    short = MetaRows(streamed.files, [3])
    with pytest.raises(UserError, match="holds 2 rows, its shard.json says 3"):
        list(short)
    (tmp_path / "meta0.jsonl").write_text("{not json\n")
    with pytest.raises(UserError, match="cannot read"):
        list(MetaRows(streamed.files, [1]))


# ---------------------------------------------------------------------------- a build's meta.jsonl


@pytest.fixture(scope="module")
def emb(run_dir, shapes_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("emb") / "emb"
    assert embed_to_shards(EmbedConfig(run=str(run_dir), data=str(shapes_dir / "train.jsonl"), out=str(out),
                                       shard_size=25))["shards"] == 4
    return out


def _listed(emb: Path, shards: int) -> bytes:
    """meta.jsonl as the build wrote it from one list: every shard's rows, ``unique_ids``, one JSON line each."""
    rows = unique_ids([r for s in range(shards) for r in load_shard(emb, s, text=False)["meta"]])
    return "".join(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in rows).encode()


def _repeat_ids(emb: Path, out: Path) -> None:
    """``emb`` copied with shard 2's ids replaced by shard 0's (its shard.json made to vouch for them)."""
    shutil.copytree(emb, out)
    first = [json.loads(line) for line in (out / "shard-00000" / "meta.jsonl").read_text().splitlines()]
    meta = out / "shard-00002" / "meta.jsonl"
    rows = [json.loads(line) for line in meta.read_text().splitlines()]
    for row, other in zip(rows, first):
        row["id"] = other["id"]
    rows[-1]["id"] = f"{first[0]['id']}#2"  # a written id that the first repeat's rename takes
    meta.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    info = json.loads((out / "shard-00002" / "shard.json").read_text())
    info["files"]["meta.jsonl"] = {"size": meta.stat().st_size, "sha256": file_sha256(meta)}
    (out / "shard-00002" / "shard.json").write_text(json.dumps(info))


@pytest.mark.parametrize("repeated", [False, True])
def test_the_version_meta_is_the_list_versions_byte_for_byte(emb, tmp_path, repeated):
    source = emb
    if repeated:
        source = tmp_path / "emb"
        _repeat_ids(emb, source)
    out = tmp_path / "index"
    build_index(IndexBuildConfig(embeddings=str(source), out=str(out), dims=[8]))
    contents = load_contents(out)
    written = (out / contents.version / META).read_bytes()
    assert written == _listed(source, 4)
    ids = [r["id"] for r in contents.meta]
    assert len(set(ids)) == len(ids) == contents.manifest["count"]
    assert any("#" in i for i in ids) == repeated
