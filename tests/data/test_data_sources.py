"""Every accepted source format reads into the same records, with lazily decoded images."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from triclip.data import DataConfig, load_pairs
from triclip.core.errors import UserError
from tests.data.data_fixtures import image_bytes, mean_colour, write_image, write_manifest, write_tar

RED, GREEN, BLUE = (200, 30, 30), (30, 200, 30), (30, 30, 200)


def _colours(pairs) -> list[tuple[int, int, int]]:
    return [mean_colour(record.open_image()) for record in pairs.records]


def _close(a, b, tol=6) -> bool:
    return all(abs(x - y) <= tol for x, y in zip(a, b))


# ---------------------------------------------------------------------------- JSONL


def test_jsonl_manifest_relative_and_absolute_paths(tmp_path: Path):
    write_image(tmp_path / "img" / "a.png", RED)
    write_image(tmp_path / "img" / "b.jpg", GREEN)
    absolute = write_image(tmp_path / "elsewhere" / "c.png", BLUE)
    manifest = write_manifest(
        tmp_path / "data" / "m.jsonl",
        [
            {"image": "../img/a.png", "captions": ["a red one", "  crimson   square "], "label": "red"},
            {"image": "../img/b.jpg", "captions": "a green one", "label": 3},
            "",
            {"image": str(absolute), "captions": ["blue", ""]},
        ],
    )
    pairs = load_pairs(manifest)
    assert [r.key for r in pairs.records] == ["../img/a.png", "../img/b.jpg", str(absolute)]
    assert [r.captions for r in pairs.records] == [["a red one", "crimson square"], ["a green one"], ["blue"]]
    assert [r.label for r in pairs.records] == ["red", 3, None]
    assert pairs.records[0].path == str(tmp_path / "img" / "a.png")
    assert not pairs.skipped
    assert pairs.source.startswith("jsonl:")
    for got, want in zip(_colours(pairs), [RED, GREEN, BLUE]):
        assert _close(got, want)
    assert pairs.records[1].open_image().mode == "RGB"


def test_jsonl_custom_field_names(tmp_path: Path):
    write_image(tmp_path / "a.png")
    manifest = write_manifest(tmp_path / "m.jsonl", [{"img": "a.png", "text": ["x", "y"], "cls": "k"}])
    pairs = load_pairs(manifest, DataConfig(image_key="img", caption_key="text", label_key="cls"))
    assert pairs.records[0].captions == ["x", "y"] and pairs.records[0].label == "k"


def test_repeated_image_gets_unique_keys(tmp_path: Path):
    write_image(tmp_path / "a.png")
    manifest = write_manifest(tmp_path / "m.jsonl", [{"image": "a.png", "captions": [c]} for c in "xyz"])
    assert [r.key for r in load_pairs(manifest).records] == ["a.png", "a.png#2", "a.png#3"]


def test_fingerprint_is_stable_and_tracks_captions(tmp_path: Path):
    write_image(tmp_path / "a.png")
    write_image(tmp_path / "b.png")
    rows = [{"image": "a.png", "captions": ["one"]}, {"image": "b.png", "captions": ["two"]}]
    first = load_pairs(write_manifest(tmp_path / "m.jsonl", rows)).fingerprint
    assert load_pairs(tmp_path / "m.jsonl").fingerprint == first
    assert len(first) == 64
    rows[1]["captions"] = ["two!"]
    assert load_pairs(write_manifest(tmp_path / "m.jsonl", rows)).fingerprint != first


# ---------------------------------------------------------------------------- CSV / TSV


def test_open_clip_csv_groups_rows_by_image(tmp_path: Path):
    write_image(tmp_path / "a.png", RED)
    write_image(tmp_path / "b.png", BLUE)
    (tmp_path / "train.csv").write_text(
        'filepath,title\na.png,"a red square, small"\nb.png,blue\n'
        "a.png,another red caption\na.png,another red caption\n",
        encoding="utf-8",
    )
    pairs = load_pairs(tmp_path / "train.csv")
    assert [r.key for r in pairs.records] == ["a.png", "b.png"]
    assert pairs.records[0].captions == ["a red square, small", "another red caption"]
    assert pairs.records[0].label is None
    assert _close(_colours(pairs)[1], BLUE)


def test_tsv_default_separator_and_label_column(tmp_path: Path):
    write_image(tmp_path / "a.png")
    (tmp_path / "d.tsv").write_text("filepath\ttitle\tlabel\na.png\tx, y\tcat\n", encoding="utf-8")
    record = load_pairs(tmp_path / "d.tsv").records[0]
    assert record.captions == ["x, y"] and record.label == "cat"


def test_csv_custom_columns_and_separator(tmp_path: Path):
    write_image(tmp_path / "a.png")
    (tmp_path / "d.csv").write_text("id;path;caption;cls\n1;a.png;hello;7\n", encoding="utf-8")
    config = DataConfig(image_key="path", caption_key="caption", label_key="cls", sep=";")
    record = load_pairs(tmp_path / "d.csv", config).records[0]
    assert (record.captions, record.label) == (["hello"], "7")


def test_csv_missing_column_is_one_line_user_error(tmp_path: Path):
    (tmp_path / "d.csv").write_text("path,caption\na.png,x\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"no column 'filepath' \(columns: path, caption\).*--image-key") as err:
        load_pairs(tmp_path / "d.csv")
    assert "\n" not in str(err.value)


def test_a_tab_separated_file_named_csv_is_sniffed_and_a_one_column_header_names_sep(tmp_path: Path):
    """A TSV named .csv used to get "choose one with --image-key"."""
    write_image(tmp_path / "a.png")
    (tmp_path / "d.csv").write_text("filepath\ttitle\na.png\tx, y\n", encoding="utf-8")
    assert load_pairs(tmp_path / "d.csv").records[0].captions == ["x, y"]
    (tmp_path / "e.csv").write_text("filepath title\na.png x\n", encoding="utf-8")  # no separator at all
    with pytest.raises(UserError, match=r"choose one with --image-key or give the separator with --sep"):
        load_pairs(tmp_path / "e.csv")
    (tmp_path / "f.csv").write_text("filepath,title\na.png,x\tz\n", encoding="utf-8")  # the extension's wins
    assert load_pairs(tmp_path / "f.csv").records[0].captions == ["x z"]


def test_an_empty_caption_on_a_repeated_path_is_counted(tmp_path: Path):
    """The empty row of an image that other rows caption was dropped uncounted."""
    write_image(tmp_path / "a.png")
    write_image(tmp_path / "b.png")
    (tmp_path / "d.csv").write_text("filepath,title\na.png,red\na.png,\nb.png,\n", encoding="utf-8")
    pairs = load_pairs(tmp_path / "d.csv")
    assert [r.key for r in pairs.records] == ["a.png"] and pairs.records[0].captions == ["red"]
    assert pairs.skipped == {"empty_caption": 2}  # a.png's empty row and b.png (no caption at all)


def test_every_path_missing_shows_one_path_tried_resolved(tmp_path: Path):
    """The error gave only counts ("skipped: missing_file=2")."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "d.csv").write_text("filepath,title\nimg/a.png,x\nimg/b.png,y\n", encoding="utf-8")
    with pytest.raises(UserError) as err:
        load_pairs(tmp_path / "sub" / "d.csv")
    text = str(err.value)
    assert "missing_file=2" in text and f"e.g. missing_file: {tmp_path / 'sub' / 'img' / 'a.png'}" in text
    assert "relative to the source file's folder, else to the current folder" in text and "\n" not in text


def test_a_path_missing_beside_the_file_is_read_from_the_current_folder_as_open_clip_reads_it(tmp_path, monkeypatch):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "d.csv").write_text("filepath,title\nimg/a.png,x\n", encoding="utf-8")
    write_image(tmp_path / "img" / "a.png")
    monkeypatch.chdir(tmp_path)  # img/a.png is here, not beside the file
    assert load_pairs(tmp_path / "sub" / "d.csv").records[0].path == str(tmp_path / "img" / "a.png")
    write_image(tmp_path / "sub" / "img" / "a.png")  # beside the file wins once it is there
    assert load_pairs(tmp_path / "sub" / "d.csv").records[0].path == str(tmp_path / "sub" / "img" / "a.png")


# ---------------------------------------------------------------------------- Hugging Face datasets


def _hf_dataset(tmp_path: Path):
    import datasets
    from PIL import Image

    images = [Image.new("RGB", (10, 8), c) for c in (RED, GREEN, BLUE)]
    features = datasets.Features(
        {
            "image": datasets.Image(),
            "text": datasets.Value("string"),
            "label": datasets.ClassLabel(names=["warm", "cold"]),
        }
    )
    columns = {"image": images, "text": ["red", "green", "blue"], "label": [0, 1, 1]}
    return datasets.Dataset.from_dict(columns, features=features)


def test_hf_dataset_saved_to_disk(tmp_path: Path):
    _hf_dataset(tmp_path).save_to_disk(str(tmp_path / "ds"))
    pairs = load_pairs(tmp_path / "ds")
    assert [r.captions for r in pairs.records] == [["red"], ["green"], ["blue"]]
    assert [r.label for r in pairs.records] == ["warm", "cold", "cold"]
    assert [r.key for r in pairs.records] == ["0", "1", "2"]
    for got, want in zip(_colours(pairs), [RED, GREEN, BLUE]):
        assert _close(got, want, tol=2)
    assert pairs.source.startswith("hf:")


def test_hf_dataset_dict_split_and_list_captions(tmp_path: Path):
    import datasets

    write_image(tmp_path / "files" / "a.png", GREEN)
    val = datasets.Dataset.from_dict({"img": ["a.png"], "sentences": [["one", "two", ""]]})
    dd = datasets.DatasetDict({"train": _hf_dataset(tmp_path), "validation": val})
    dd.save_to_disk(str(tmp_path / "files"))
    pairs = load_pairs(tmp_path / "files", DataConfig(split="validation", image_key="img"))
    assert pairs.records[0].captions == ["one", "two"]
    assert _close(mean_colour(pairs.records[0].open_image()), GREEN)  # a path column, relative to the dataset
    with pytest.raises(UserError, match=r"no split 'test' \(splits: train, validation\)"):
        load_pairs(tmp_path / "files", DataConfig(split="test"))


# ---------------------------------------------------------------------------- WebDataset


def _shard(path: Path, start: int, colours) -> Path:
    members = {}
    for i, colour in enumerate(colours, start):
        members[f"sub/{i:04d}.jpg"] = image_bytes(colour, fmt="JPEG")
        members[f"sub/{i:04d}.txt"] = f"caption {i}".encode()
        members[f"sub/{i:04d}.cls"] = str(i % 2).encode()
    return write_tar(path, members)


def test_webdataset_single_shard(tmp_path: Path):
    shard = _shard(tmp_path / "s-000.tar", 0, [RED, GREEN])
    pairs = load_pairs(shard)
    assert [r.key for r in pairs.records] == ["s-000.tar/sub/0000", "s-000.tar/sub/0001"]
    assert [r.captions for r in pairs.records] == [["caption 0"], ["caption 1"]]
    assert [r.label for r in pairs.records] == [0, 1]
    for got, want in zip(_colours(pairs), [RED, GREEN]):
        assert _close(got, want, tol=12)  # JPEG
    assert pairs.records[0].path.endswith("s-000.tar#sub/0000.jpg")


def test_webdataset_brace_pattern_and_directory(tmp_path: Path):
    _shard(tmp_path / "s-000.tar", 0, [RED])
    _shard(tmp_path / "s-001.tar", 1, [GREEN, BLUE])
    by_pattern = load_pairs(str(tmp_path / "s-{000..001}.tar"))
    by_folder = load_pairs(tmp_path)
    assert [r.captions[0] for r in by_pattern.records] == ["caption 0", "caption 1", "caption 2"]
    assert by_folder.fingerprint == by_pattern.fingerprint
    with pytest.raises(UserError, match="shard not found: .*s-002.tar"):
        load_pairs(str(tmp_path / "s-{000..002}.tar"))


def test_webdataset_png_and_custom_extensions(tmp_path: Path):
    shard = write_tar(tmp_path / "x.tar", {"k.png": image_bytes(BLUE), "k.caption": b"blue thing", "k.txt": b"ignored"})
    record = load_pairs(shard, DataConfig(caption_key="caption")).records[0]
    assert record.captions == ["blue thing"] and _close(mean_colour(record.open_image()), BLUE)


# ---------------------------------------------------------------------------- paths and formats


def test_missing_path_and_unknown_format_are_user_errors(tmp_path: Path):
    with pytest.raises(UserError, match="data source not found"):
        load_pairs(tmp_path / "nope.jsonl")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(UserError, match="cannot tell the format of .*notes.txt: expected a .jsonl manifest"):
        load_pairs(tmp_path / "notes.txt")
    os.mkdir(tmp_path / "empty")
    with pytest.raises(UserError, match="cannot tell the format"):
        load_pairs(tmp_path / "empty")
