"""The meta rows of a version read when asked (triclip.index.metafile) against the list and dict they replace."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from triclip.app.cli import main
from triclip.core.errors import UserError
from triclip.index import filecheck, metafile, store
from triclip.index.sources import IndexBuildConfig, build_index
from triclip.index.metafile import LazyMeta, id_rows, write_meta
from triclip.index.search import Searcher
from triclip.data.builtin import prepare


def _damaged(what: str) -> UserError:
    return UserError(f"damaged: {what}")


def _open(folder: Path, rows: list[dict]) -> LazyMeta:
    assert write_meta(folder, "meta.jsonl", rows) == len(rows)
    arrays = {name: np.load(folder / name, mmap_mode="r") for name in metafile.FILES}
    return metafile.open_meta(folder, "meta.jsonl", len(rows), arrays, _damaged)


def _rows(n: int) -> list[dict]:
    rows = [{"id": f"img_{i % 37}" + ("#2" if i % 37 != i else ""), "image": f"/x/é{i}.png",
             "captions": [f"caption {i}", "ünïcode ✓ \u2028 line"][: 1 + i % 2], "label": i % 3} for i in range(n)]
    rows[5]["id"] = rows[3]["id"]  # a repeated id: the dict keeps the last row
    return rows


def test_lazy_rows_equal_the_list(tmp_path):
    rows = _rows(60)
    meta = _open(tmp_path, rows)
    assert len(meta) == 60 and list(meta) == rows
    assert [meta[i] for i in range(60)] == rows and meta[-1] == rows[-1] and meta[10:20] == rows[10:20]
    assert meta + [{"id": "new", "captions": []}] == rows + [{"id": "new", "captions": []}]  # an --add
    with pytest.raises(IndexError):
        meta[60]
    lines = (tmp_path / "meta.jsonl").read_text(encoding="utf-8").split("\n")[:-1]
    assert [json.loads(line) for line in lines] == rows  # the file itself is what the list reader reads


def test_rows_read_together_equal_them_one_by_one_and_are_asked_for_first(tmp_path, monkeypatch):
    rows = _rows(60)
    meta = _open(tmp_path, rows)
    asked = []
    monkeypatch.setattr(metafile.os, "posix_fadvise", lambda fd, start, length, how: asked.append((fd, start, length)),
                        raising=False)
    want = [7, 59, 0, -1, 7]
    assert meta.rows(want) == [rows[i] for i in want] and meta.rows([]) == [] and meta.rows([3]) == [rows[3]]
    offsets = np.load(tmp_path / metafile.OFFSETS)
    lines = [(meta._fd, int(offsets[i]), int(offsets[i + 1] - offsets[i])) for i in (7, 59, 0, 59, 7)]
    assert [a for a in asked if a[0] == meta._fd] == lines  # every line asked for before the first is read
    assert [a[1:] for a in asked if a[0] != meta._fd] == [(meta.offsets.offset + 8 * i, 16) for i in (7, 59, 0, 59, 7)]
    with pytest.raises(IndexError):
        meta.rows([1, 60])


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="Linux: the mapping's flags are read from smaps")
def test_the_arrays_are_mapped_for_random_reads(tmp_path):
    meta = _open(tmp_path, _rows(60))
    flags, current = {}, None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            current = line.split()[-1] if len(line.split()) >= 6 else None
        elif line.startswith("VmFlags:") and current:
            flags.setdefault(Path(current).name, []).append(line.split()[1:])
    for name in metafile.FILES:  # "rr": MADV_RANDOM, a fault reads one page and no read-ahead window
        assert flags.get(name) and all("rr" in f for f in flags[name]), (name, flags.get(name))
    assert meta[3]["id"] == "img_3"


def test_lookups_equal_the_dict(tmp_path):
    rows = _rows(60)
    ids, want = id_rows(_open(tmp_path, rows)), {row["id"]: i for i, row in enumerate(rows)}
    assert {rid: ids[rid] for rid in want} == want and len(set(ids)) == len(want) and set(ids) == set(want)
    for absent in ("img_99", "img_1#3", "", "IMG_1", 7, None):
        assert absent not in ids and ids.get(absent) is None


def test_equal_hashes_are_told_apart_by_the_string(tmp_path, monkeypatch):
    rows = _rows(40)
    monkeypatch.setattr(metafile, "id_hash", lambda rid: 0)  # every id hashes alike: the rows' own ids decide
    meta = _open(tmp_path, rows)
    assert not meta.hashes.any() and (np.asarray(meta.order) == np.arange(40)).all()
    for monkey in ("img_3", "img_4", "img_2#2"):
        assert meta.ids.get(monkey) == max(i for i, r in enumerate(rows) if r["id"] == monkey)
    assert meta.ids.get("img_99") is None


def test_a_torn_line_is_one_line_naming_the_row(tmp_path):
    meta = _open(tmp_path, _rows(10))
    meta.offsets = np.array(meta.offsets, copy=True)
    meta.offsets[4] += 3  # row 3 ends, and row 4 begins, mid-line
    with pytest.raises(UserError, match="row 3 of meta.jsonl does not read"):
        meta[3]


# ---------------------------------------------------------------------------- versions


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    """40 shapes records with 8 repeated images (renamed ids ``key#2``), and 20 more for an --add."""
    out = tmp_path_factory.mktemp("shapes_meta")
    prepare("shapes", str(out), num=80, seed=0)
    rows = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines() if line.strip()]
    for row in rows:
        row["image"] = str((out / row["image"]).resolve())
    again = [dict(r, captions=[c + " again" for c in r["captions"]]) for r in rows[:8]]
    first, second = out / "a.jsonl", out / "b.jsonl"
    first.write_text("".join(json.dumps(r) + "\n" for r in rows[:32] + again))
    second.write_text("".join(json.dumps(r) + "\n" for r in rows[32:52]))
    return first, second


@pytest.fixture(scope="module")
def lazy_index(tmp_path_factory, run_dir, data) -> Path:
    out = tmp_path_factory.mktemp("lazy") / "index"
    build_index(IndexBuildConfig(run=str(run_dir), data=str(data[0]), out=str(out), dims=[8, 32], factory="Flat"))
    return out


def _copy(index: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(index, tmp_path / "index"))


def _file_rows(index: Path) -> list[dict]:
    v = index / (index / "CURRENT").read_text().strip()
    return [json.loads(line) for line in (v / "meta.jsonl").read_text(encoding="utf-8").splitlines()]


def test_a_version_serves_its_rows_lazily(lazy_index):
    rows = _file_rows(lazy_index)
    assert sum(r["id"].endswith("#2") for r in rows) == 8  # renamed ids
    s = Searcher.load(lazy_index, text_only=True)
    assert isinstance(s.contents.meta, LazyMeta) and list(s.contents.meta) == rows and len(s) == 40
    assert {r["id"]: s._rows[r["id"]] for r in rows} == {r["id"]: i for i, r in enumerate(rows)}
    np.testing.assert_array_equal(s.vectors_of([r["id"] for r in rows]), s.contents.vectors)
    hits = s.search_ids([rows[20]["id"]], k=1)[0]
    assert hits[0]["id"] == rows[20]["id"] and hits[0]["image"] == rows[20]["image"]
    with pytest.raises(UserError, match="unknown id"):
        s.vectors_of([rows[0]["id"] + "#9"])


def test_an_old_version_without_the_files_still_serves(tmp_path, lazy_index):
    index = _copy(lazy_index, tmp_path)
    v = index / (index / "CURRENT").read_text().strip()
    manifest = json.loads((v / "manifest.json").read_text())
    for name in metafile.FILES:
        (v / name).unlink()
        del manifest[filecheck.FILES][name]
    (v / "manifest.json").write_text(json.dumps(manifest))
    old, new = Searcher.load(index, text_only=True), Searcher.load(lazy_index, text_only=True)
    assert isinstance(old.contents.meta, list) and isinstance(old._rows, dict)
    assert old.contents.meta == list(new.contents.meta)
    assert old.search_text(["a red circle", "blue square"], k=5) == new.search_text(["a red circle", "blue square"], k=5)


TAMPER = {
    "offsets shifted": (metafile.OFFSETS, lambda a: a + (np.arange(len(a)) > 3)),
    "hashes of another index": (metafile.ID_HASHES, lambda a: np.sort(a ^ np.uint64(1))),
    "rows reversed": (metafile.ID_ROWS, lambda a: a[::-1].copy()),
}


@pytest.mark.parametrize("tamper", sorted(TAMPER))
def test_a_tampered_offset_or_hash_file_is_refused_in_one_line(tmp_path, capsys, lazy_index, tamper):
    index = _copy(lazy_index, tmp_path)
    v = index / (index / "CURRENT").read_text().strip()
    name, change = TAMPER[tamper]
    np.save(v / name, change(np.load(v / name)))
    with pytest.raises(UserError, match=re.escape(name)):
        store.load_contents(index)
    code = main(["search", "--index", str(index), "--text", "a red circle", "--json"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"{name} is not the file this version wrote" in err, err


def test_add_keeps_the_rows_lazy_and_the_ids_unique(tmp_path, run_dir, lazy_index, data):
    index = _copy(lazy_index, tmp_path)
    build_index(IndexBuildConfig(run=str(run_dir), data=str(data[1]), out=str(index), add=True))
    rows = _file_rows(index)
    s = Searcher.load(index, text_only=True)
    assert isinstance(s.contents.meta, LazyMeta) and len(s) == 60 and list(s.contents.meta) == rows
    assert rows[:40] == _file_rows(lazy_index) and len({r["id"] for r in rows}) == 60
    assert all(s._rows[r["id"]] == i for i, r in enumerate(rows))


def test_caption_texts_equal_the_rows_in_either_order(tmp_path):
    from triclip.index.manifest import text_rows
    from triclip.index.search import _caption_texts

    rows = _rows(30)
    meta, pairs = _open(tmp_path, rows), text_rows(rows)  # (T, 2)
    for order in (np.arange(len(pairs)), np.random.default_rng(0).permutation(len(pairs))):
        want = [(int(r), rows[r]["captions"][c]) for r, c in pairs[order]]
        assert list(_caption_texts(meta, pairs[order])) == want and len(want) == 45


def test_rows_outlive_the_version_folder(tmp_path):
    """A writer removes a replaced version while a reader still serves it (an --add swapped in)."""
    rows = _rows(5000)  # more than one block of the iteration
    folder = tmp_path / "v000001"
    folder.mkdir()
    meta = _open(folder, rows)
    shutil.rmtree(folder)
    assert meta[4321] == rows[4321] and list(meta) == rows and meta.ids["img_7"] == 7
    assert meta.rows([4321, 7]) == [rows[4321], rows[7]]  # the offsets' file was opened with the version
