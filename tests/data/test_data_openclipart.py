"""openclipart: the SVG metadata parser (real files and odd variants), thumbnails, the builder."""

from __future__ import annotations

import hashlib
import json
import os
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import pytest
from PIL import Image

from triclip.data import load_pairs, openclipart
from triclip.data.builtin import prepare
from triclip.data.svgmeta import SvgMeta, _decode, _from_text, _from_tree, parse_svg_metadata, read_svg_metadata

SVG = os.path.join(openclipart.ROOT, "svg")
PNG = os.path.join(openclipart.ROOT, "png")
needs_package = pytest.mark.skipif(
    not (os.path.isdir(SVG) and os.path.isdir(PNG)), reason="Debian packages openclipart-svg/png not installed"
)

WORK = """<?xml version="1.0" encoding="{encoding}"?>
<svg xmlns="http://www.w3.org/2000/svg" {ns}><metadata><{r}:RDF><{c}:Work>{fields}
<{d}:creator><{c}:Agent><{d}:title>The Creator</{d}:title></{c}:Agent></{d}:creator>
</{c}:Work></{r}:RDF></metadata><rect width="1" height="1"/></svg>"""


def _svg(fields: str, encoding: str = "UTF-8", prefixes=("rdf", "cc", "dc")) -> str:
    r, c, d = prefixes
    ns = (
        f'xmlns:{r}="http://www.w3.org/1999/02/22-rdf-syntax-ns#" xmlns:{c}="http://web.resource.org/cc/" '
        f'xmlns:{d}="http://purl.org/dc/elements/1.1/"'
    )
    return WORK.format(encoding=encoding, ns=ns, r=r, c=c, d=d, fields=fields.format(r=r, d=d))


# ---------------------------------------------------------------------------- parser, real files


@needs_package
def test_real_file_with_title_description_keywords():
    meta = read_svg_metadata(os.path.join(SVG, "animals/2_dead_frogs_lumen_desig_01.svg"))
    assert meta.title == "2 dead frogs"  # not "Lumen Design Studio", the creator's dc:title
    assert meta.description == "2 dead frogs... nothing more..."
    assert meta.keywords[:3] == ["kwaakwaa", "squeleton", "froggies"] and len(meta.keywords) == 23
    assert meta.train_captions() == ["2 dead frogs", "2 dead frogs... nothing more...", ", ".join(meta.keywords)]
    assert meta.query_caption() == "2 dead frogs"


@needs_package
def test_real_files_empty_title_svg_title_fallback_and_accents():
    flag = read_svg_metadata(os.path.join(SVG, "signs_and_symbols/flags/america/united_states/usa_arizona.svg"))
    assert flag == SvgMeta("", "", ["america", "flag", "unitedstates", "sign"])  # an empty <rdf:li> dropped
    assert flag.query_caption() == "" and flag.train_captions() == ["america, flag, unitedstates, sign"]
    scorpion = read_svg_metadata(os.path.join(SVG, "animals/scorpion-md-v0.1.svg"))
    assert scorpion.title == "Scorpion"  # empty dc:title; the SVG's <title> element
    arrow = read_svg_metadata(os.path.join(SVG, "shapes/arrows/direction_suivre_1_yves__01.svg"))
    assert (arrow.title, arrow.description) == ("direction à suivre 1", "lutte incendie")
    latin1 = read_svg_metadata(os.path.join(SVG, "recreation/art/airbrush_alejandro_tejad_.svg"))  # iso-8859-1
    assert latin1.title == "Airbrush" and latin1.keywords == ["art", "tool", "airbrush"]
    assert read_svg_metadata(os.path.join(SVG, "animals/birds/tacchino_architetto_fran_01.svg")).title == "Tacchino"


@needs_package
def test_regex_fallback_agrees_with_the_xml_parser_on_real_files():
    names = ["animals/2_dead_frogs_lumen_desig_01.svg", "animals/scorpion-md-v0.1.svg",
             "shapes/arrows/direction_suivre_1_yves__01.svg", "recreation/art/airbrush_alejandro_tejad_.svg"]
    for name in names:
        data = Path(SVG, name).read_bytes()
        assert _from_text(_decode(data)) == _from_tree(ET.fromstring(data))


@needs_package
def test_metadata_read_on_worker_processes_equals_the_read_in_this_one(monkeypatch):
    """The clips (and what was skipped, and why) of 300 names and an absent one, in the names' order either way."""
    names = openclipart.list_clipart(SVG)[:300] + ["no_such_folder/no_such_clip"]
    inline_skipped, pool_skipped = Counter(), Counter()
    monkeypatch.setattr(openclipart, "MIN_POOL_JOBS", 10**6)
    inline = openclipart.read_clips(names, inline_skipped)
    monkeypatch.setattr(openclipart, "MIN_POOL_JOBS", 1)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    pool = openclipart.read_clips(names, pool_skipped)
    assert pool == inline and len(inline) > 250 and [c.name for c in inline] == sorted(c.name for c in inline)
    assert pool_skipped == inline_skipped and inline_skipped["missing_file"] >= 1


@pytest.mark.slow
@needs_package
def test_regex_fallback_agrees_with_the_xml_parser_on_every_file():
    count = 0
    for folder, _, files in os.walk(SVG):
        for name in files:
            data = Path(folder, name).read_bytes()
            assert _from_text(_decode(data)) == _from_tree(ET.fromstring(data)), name
            count += 1
    assert count == 8121


# ---------------------------------------------------------------------------- parser, odd variants


def test_other_prefixes_and_alt_titles():
    fields = (
        "<{d}:title><{r}:Alt><{r}:li xml:lang='it'>Gatto</{r}:li><{r}:li>Cat</{r}:li></{r}:Alt></{d}:title>"
        "<{d}:description>A   black\n cat</{d}:description>"
        "<{d}:subject><{r}:Bag><{r}:li>cat</{r}:li><{r}:li>cat</{r}:li><{r}:li> pet </{r}:li></{r}:Bag></{d}:subject>"
    )
    meta = parse_svg_metadata(_svg(fields, prefixes=("R", "C", "DC")).encode())
    assert meta == SvgMeta("Gatto", "A black cat", ["cat", "pet"])


def test_plain_text_keywords_and_missing_fields():
    meta = parse_svg_metadata(_svg("<{d}:subject>tree, plant; green</{d}:subject>").encode())
    assert meta == SvgMeta("", "", ["tree", "plant", "green"])
    assert meta.train_captions() == ["tree, plant, green"] and meta.query_caption() == ""


def test_no_metadata_at_all():
    assert parse_svg_metadata(b'<svg xmlns="http://www.w3.org/2000/svg"><rect/></svg>') == SvgMeta()
    assert parse_svg_metadata(b"") == SvgMeta()
    assert parse_svg_metadata(b"\x00\xff garbage") == SvgMeta()


def test_bad_bytes_and_undefined_entities_use_the_tolerant_reader():
    fields = "<{d}:title>Caf\xe9 &amp; bar&nbsp;</{d}:title><{d}:description>d&eacute;j&#224; vu</{d}:description>"
    latin1 = _svg(fields, encoding="UTF-8").encode("latin-1")  # declared UTF-8, is not; &nbsp; is undeclared
    with pytest.raises(ET.ParseError):
        ET.fromstring(latin1)
    meta = parse_svg_metadata(latin1)
    assert meta.title == "Café & bar" and meta.description == "déjà vu"
    declared = _svg("<{d}:title>Caf\xe9</{d}:title>", encoding="ISO-8859-1").encode("latin-1")
    assert parse_svg_metadata(declared).title == "Café"


# ---------------------------------------------------------------------------- thumbnails and the builder


def _rows(folder: Path, split: str) -> list[dict]:
    return [json.loads(line) for line in (folder / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@needs_package
def test_thumbnail_of_a_real_transparent_png_and_of_a_real_bomb(tmp_path: Path):
    source = os.path.join(PNG, "animals/2_dead_frogs_lumen_desig_01.png")
    with Image.open(source) as original:
        assert "A" in original.mode or "transparency" in original.info
    thumb = openclipart.make_thumbnail((source, str(tmp_path / "a.png"), 40_000_000))
    assert thumb.reason is None and thumb.path == str(tmp_path / "a.png")
    assert thumb.original == _sha(Path(source)) and thumb.digest == _sha(tmp_path / "a.png")
    with Image.open(tmp_path / "a.png") as small:
        assert max(small.size) == 224 and small.mode == "RGB"
        assert small.getpixel((0, 0)) == (255, 255, 255)  # transparency composited on white
    bomb = os.path.join(PNG, "signs_and_symbols/stop_sign_miguel_s_nchez_.png")  # 623 M pixels: header only
    assert openclipart.make_thumbnail((bomb, str(tmp_path / "c.png"), 40_000_000)).reason == "decompression_bomb"
    assert openclipart.make_thumbnail((str(tmp_path / "none.png"), str(tmp_path / "d.png"), 40_000_000)).reason == (
        "missing_file"
    )
    assert not (tmp_path / "c.png").exists() and not (tmp_path / "d.png").exists()


def test_copies_become_one_row_with_the_union_of_captions():
    clip = openclipart.Clip
    clips = [
        clip("animals/cat", ["Cat", "a cat", "cat, pet"], "Cat", "/real/cat.png"),
        clip("pets/cat", ["Cat", "a cat", "cat, pet"], "Cat", "/real/cat.png"),  # a symlink: same source
        clip("pets/kitty", ["Kitty", "cat, pet"], "Kitty", "/real/kitty.png"),  # another file, same thumbnail
        clip("pets/untitled", ["cat"], "", "/real/untitled.png"),  # same thumbnail, no title
        clip("shapes/box", ["Box"], "Box", "/real/box.png"),
        clip("shapes/bomb", ["Bomb"], "Bomb", "/real/bomb.png"),
    ]
    thumbs = {
        "/real/cat.png": openclipart.Thumb(None, "o1", "t1", "x"),
        "/real/kitty.png": openclipart.Thumb(None, "o2", "t1", "y"),
        "/real/untitled.png": openclipart.Thumb(None, "o3", "t1", "z"),
        "/real/box.png": openclipart.Thumb(None, "o4", "t2", "w"),
        "/real/bomb.png": openclipart.Thumb("decompression_bomb"),
    }
    skipped = Counter()
    groups = openclipart.group_images(clips, thumbs, skipped)
    assert skipped == {"decompression_bomb": 1}
    assert [[c.name for c in g] for g in groups.values()] == [
        ["animals/cat", "pets/cat", "pets/kitty", "pets/untitled"], ["shapes/box"]
    ]
    cats = groups["t1"]
    assert openclipart.image_row(cats, "train") == {
        "image": "images/animals/cat.png", "captions": ["Cat", "a cat", "cat, pet", "Kitty", "cat"], "label": "animals"
    }
    for split in ("val", "test"):  # queries only: the distinct titles
        assert openclipart.image_row(cats, split)["captions"] == ["Cat", "Kitty"]
    assert openclipart.image_row(cats[3:], "test") is None  # no title: nothing to query with


@needs_package
def test_symlinks_and_identical_thumbnails_of_real_files_are_one_image(tmp_path: Path, monkeypatch):
    # two real hub drawings (different files, byte-identical thumbnails), each symlinked into a second folder
    names = ["computer/8port_hub_ruairi_hann_r", "computer/hardware/8port_hub_ruairi_hann_r",
             "computer/hardware/hub_ruairi_hann_r", "computer/hub_ruairi_hann_r", "animals/2_dead_frogs_lumen_desig_01",
             "signs_and_symbols/flags/america/united_states/usa_arizona"]  # keywords only: no query
    monkeypatch.setattr(openclipart, "list_clipart", lambda root: sorted(names))
    summary = prepare("openclipart", tmp_path)
    assert summary["duplicates_merged"] == 3
    rows = {split: _rows(tmp_path, split) for split in ("train", "val", "test")}
    arizona = {"image": "images/signs_and_symbols/flags/america/united_states/usa_arizona.png",
               "captions": ["america, flag, unitedstates, sign"], "label": "signs_and_symbols"}
    if arizona in rows["train"]:
        assert summary["train"] + summary["val"] + summary["test"] == 3 and summary["skipped"] == {}
    else:  # in val or test, with no title to query with
        assert summary["train"] + summary["val"] + summary["test"] == 2 and summary["skipped"] == {"empty_caption": 1}
    hub = next(row for split in rows.values() for row in split if "hub" in row["image"])
    assert hub["image"] == "images/computer/8port_hub_ruairi_hann_r.png" and hub["label"] == "computer"
    in_train = any(row is hub for row in rows["train"])
    assert hub["captions"] == (["5 port hub", "Derived from Andrew Fitzsimons scanner",
                                "hash, hub, switch, hardware, computer", "Hub",
                                "A small five port hub, edited from andrew fitzsimons scanner.",
                                "hash, hub, hardware, computer"] if in_train else ["5 port hub", "Hub"])
    files = sorted(p.relative_to(tmp_path).as_posix() for p in (tmp_path / "images").rglob("*.png"))
    assert files == sorted(row["image"] for split in rows.values() for row in split)  # copies' thumbnails removed


@needs_package
def test_prepare_a_capped_openclipart(tmp_path: Path):
    summary = prepare("openclipart", tmp_path, num=40)
    counts = [summary[split] for split in ("train", "val", "test")]
    assert sum(counts) + summary["duplicates_merged"] + sum(summary["skipped"].values()) == 40
    assert all(counts) and abs(summary["val"] - sum(counts) / 10) < 1 and abs(summary["test"] - sum(counts) / 10) < 1
    categories = set(os.listdir(SVG))
    rows = {split: _rows(tmp_path, split) for split in ("train", "val", "test")}
    assert len({row["label"] for row in rows["train"]}) > 5  # hash order spreads the cap over categories
    hashes = {}
    for split, split_rows in rows.items():
        for row in split_rows:
            name = row["image"][len("images/") : -len(".png")]
            assert row["label"] == name.split("/")[0] and row["label"] in categories
            meta = read_svg_metadata(os.path.join(SVG, name + ".svg"))
            own = meta.train_captions() if split == "train" else [meta.query_caption()]
            assert row["captions"][: len(own)] == own and all(row["captions"])
            with Image.open(tmp_path / row["image"]) as thumb:
                assert max(thumb.size) <= 224
            hashes[_sha(tmp_path / row["image"])] = split
    assert len(hashes) == sum(counts)  # every row a distinct image
    assert load_pairs(tmp_path / "test.jsonl").skipped == {}
    again = tmp_path / "again"
    prepare("openclipart", again, num=40)
    for split in ("train", "val", "test"):
        assert (again / f"{split}.jsonl").read_bytes() == (tmp_path / f"{split}.jsonl").read_bytes()
    other = tmp_path / "seed1"
    prepare("openclipart", other, num=40, seed=1)
    assert (other / "val.jsonl").read_bytes() != (tmp_path / "val.jsonl").read_bytes()


@needs_package
def test_worker_processes_make_the_same_thumbnails(tmp_path: Path, monkeypatch):
    prepare("openclipart", tmp_path / "inline", num=6)
    monkeypatch.setattr(openclipart, "MIN_POOL_JOBS", 1)
    monkeypatch.setattr(openclipart, "WORKERS", 2)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    prepare("openclipart", tmp_path / "pool", num=6)
    inline, pool = sorted((tmp_path / "inline").rglob("*.*")), sorted((tmp_path / "pool").rglob("*.*"))
    assert [p.relative_to(tmp_path / "inline") for p in inline] == [p.relative_to(tmp_path / "pool") for p in pool]
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(inline, pool)) and len(inline) >= 8


@pytest.mark.slow
@needs_package
def test_prepare_the_whole_openclipart_without_duplicates(tmp_path: Path):
    summary = prepare("openclipart", tmp_path)
    counts = {split: summary[split] for split in ("train", "val", "test")}
    total = sum(counts.values())
    assert total + summary["duplicates_merged"] + sum(summary["skipped"].values()) == 8121
    assert 6700 <= total <= 6900 and summary["duplicates_merged"] >= 1221  # at least every symlink
    assert summary["skipped"]["decompression_bomb"] >= 16  # the originals above 40 M pixels
    images = total + summary["skipped"]["empty_caption"] - 6  # 6 names have no caption at all
    for split in ("val", "test"):  # 10% each of the distinct images, less those without a title
        assert images / 10 - 10 < counts[split] <= images / 10 + 1
    owner: dict[str, str] = {}
    for split in counts:
        pairs = load_pairs(tmp_path / f"{split}.jsonl")
        assert not pairs.skipped and len(pairs) == counts[split] and all(c for r in pairs.records for c in r.captions)
        for record in pairs.records:
            digest = _sha(Path(record.path))
            assert digest not in owner, f"{record.path} repeats an image of {owner.get(digest)}"
            owner[digest] = split
    labels = {r.label for r in load_pairs(tmp_path / "train.jsonl").records}
    assert len(labels) >= len(os.listdir(SVG)) - 1
    assert sum(1 for _ in (tmp_path / "images").rglob("*.png")) == total
