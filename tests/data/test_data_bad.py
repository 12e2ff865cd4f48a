"""Bad records of every kind are skipped and counted by reason, in every format; never a crash."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from triclip.data import BadRecord, DataConfig, FileImage, decode_image, inspect, load_pairs, probe_image
from triclip.data.images import pixel_limit
from triclip.core.errors import UserError
from tests.data.data_fixtures import (
    bomb_png_bytes,
    image_bytes,
    write_image,
    write_manifest,
    write_tar,
    write_truncated_png,
)


def _mixed_manifest(tmp_path: Path) -> Path:
    """2 good records and one of every bad kind."""
    write_image(tmp_path / "good1.png")
    write_image(tmp_path / "good2.jpg")
    write_truncated_png(tmp_path / "truncated.png")
    (tmp_path / "garbage.png").write_bytes(b"this is not an image at all")
    (tmp_path / "bomb.png").write_bytes(bomb_png_bytes(8000, 6000))  # 48 M pixels > 40 M default
    (tmp_path / "pillow_bomb.png").write_bytes(bomb_png_bytes(30000, 30000))  # > 2x Pillow's own limit
    return write_manifest(
        tmp_path / "m.jsonl",
        [
            {"image": "good1.png", "captions": ["fine"]},
            {"image": "good2.jpg", "captions": ["also fine", ""]},
            {"image": "missing.png", "captions": ["gone"]},
            {"image": "truncated.png", "captions": ["cut"]},
            {"image": "garbage.png", "captions": ["junk"]},
            {"image": "good1.png", "captions": ["", "   "]},
            {"image": "good1.png", "captions": []},
            {"image": "bomb.png", "captions": ["big"]},
            {"image": "pillow_bomb.png", "captions": ["huge"]},
            '{"image": "good1.png", "captions": ["unterminated',
            {"picture": "good1.png", "captions": ["wrong field"]},
            {"image": "good1.png", "captions": 42},
            {"image": "", "captions": ["no path"]},
            "[1, 2]",
        ],
    )


def test_load_counts_every_reason_from_headers_only(tmp_path: Path):
    pairs = load_pairs(_mixed_manifest(tmp_path))
    # the truncated PNG has a valid header: loading is cheap, so it is caught at decode time
    assert [r.key for r in pairs.records] == ["good1.png", "good2.jpg", "truncated.png"]
    assert pairs.skipped == {
        "missing_file": 1,
        "corrupt_image": 1,
        "empty_caption": 2,
        "decompression_bomb": 2,
        "bad_row": 5,
    }


def test_inspect_decodes_fully_and_catches_truncation(tmp_path: Path):
    report = inspect(_mixed_manifest(tmp_path))
    assert report["records"] == 2
    assert report["skipped"] == {
        "bad_row": 5,
        "corrupt_image": 2,
        "decompression_bomb": 2,
        "empty_caption": 2,
        "missing_file": 1,
    }
    assert report["captions"] == 2 and report["labels"] == 0 and len(report["fingerprint"]) == 64


def test_open_image_raises_bad_record_with_reason(tmp_path: Path):
    pairs = load_pairs(_mixed_manifest(tmp_path))
    with pytest.raises(BadRecord) as err:
        pairs.records[2].open_image()
    assert err.value.reason == "corrupt_image"
    with pytest.raises(BadRecord) as err:
        decode_image(FileImage(str(tmp_path / "nowhere.png")))
    assert err.value.reason == "missing_file"


def test_a_text_file_named_png_is_a_corrupt_image_named_in_words(tmp_path: Path):
    text = tmp_path / "notes.png"
    text.write_text("not a picture\n")
    with pytest.raises(BadRecord) as err:
        decode_image(FileImage(str(text)))
    assert err.value.reason == "corrupt_image" and str(text) in str(err.value)
    assert "not an image file Pillow can read" in str(err.value) and "BufferedReader" not in str(err.value)


def test_pixel_limit_is_configurable_but_never_above_pillows(tmp_path: Path):
    path = write_image(tmp_path / "a.png", size=(10, 10))
    assert probe_image(FileImage(str(path)), max_pixels=100) == (10, 10)
    with pytest.raises(BadRecord, match="decompression_bomb"):
        probe_image(FileImage(str(path)), max_pixels=99)
    assert pixel_limit(10**12) == Image.MAX_IMAGE_PIXELS  # Pillow's limit stays in force
    (tmp_path / "b.png").write_bytes(bomb_png_bytes(10000, 9000))  # 90 M: above Pillow's 89.5 M
    with pytest.raises(BadRecord, match="decompression_bomb"):
        probe_image(FileImage(str(tmp_path / "b.png")), max_pixels=10**12)
    manifest = write_manifest(tmp_path / "m.jsonl", [{"image": "a.png", "captions": ["x"]}])
    with pytest.raises(UserError, match="decompression_bomb=1"):
        load_pairs(manifest, DataConfig(max_pixels=50))
    with pytest.raises(UserError, match="max_pixels"):  # one line in the CLI, not a traceback
        DataConfig(max_pixels=0)


def test_all_bad_is_one_clear_error(tmp_path: Path):
    manifest = write_manifest(
        tmp_path / "m.jsonl", [{"image": "a.png", "captions": ["x"]}, {"image": "b.png", "captions": [""]}, "not json"]
    )
    with pytest.raises(UserError) as err:
        load_pairs(manifest)
    message = str(err.value)
    assert "no usable records" in message and "\n" not in message
    assert "bad_row=1" in message and "empty_caption=1" in message and "missing_file=1" in message


def test_inspect_fails_when_nothing_decodes(tmp_path: Path):
    write_truncated_png(tmp_path / "t.png")
    manifest = write_manifest(tmp_path / "m.jsonl", [{"image": "t.png", "captions": ["x"]}])
    with pytest.raises(UserError, match="no usable records.*corrupt_image"):
        inspect(manifest)


def test_csv_bad_rows(tmp_path: Path):
    write_image(tmp_path / "a.png")
    write_truncated_png(tmp_path / "t.png")
    (tmp_path / "d.csv").write_text(
        "filepath,title\na.png,good\nb.png\nc.png,x,extra\n,no image\nempty.png,\nmissing.png,gone\nt.png,cut\n",
        encoding="utf-8",
    )
    write_image(tmp_path / "empty.png")
    pairs = load_pairs(tmp_path / "d.csv")
    assert [r.key for r in pairs.records] == ["a.png", "t.png"]
    assert pairs.skipped == {"bad_row": 3, "empty_caption": 1, "missing_file": 1}
    assert inspect(tmp_path / "d.csv")["skipped"]["corrupt_image"] == 1


def test_hf_bad_cells(tmp_path: Path):
    import datasets

    features = datasets.Features({"image": datasets.Image(), "text": datasets.Value("string")})
    good, garbage = {"bytes": image_bytes(), "path": None}, {"bytes": b"garbage", "path": None}
    bomb = {"bytes": bomb_png_bytes(9000, 9000), "path": None}
    rows = {
        "image": [good, None, garbage, good, good, bomb],
        "text": ["ok", "no image", "junk", "", None, "big"],
    }
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(str(tmp_path / "ds"))
    pairs = load_pairs(tmp_path / "ds")
    assert [r.captions for r in pairs.records] == [["ok"]]
    assert pairs.skipped == {"missing_file": 1, "corrupt_image": 1, "empty_caption": 2, "decompression_bomb": 1}


def test_webdataset_bad_samples(tmp_path: Path):
    truncated = image_bytes(size=(64, 64), noise=True)
    shard = write_tar(
        tmp_path / "s.tar",
        {
            "a.jpg": image_bytes(fmt="JPEG"),
            "a.txt": b"good",
            "b.txt": b"caption without image",
            "c.png": image_bytes(),
            "d.png": image_bytes(),
            "d.txt": b"  \n ",
            "e.png": b"\x89PNG garbage",
            "e.txt": b"garbage",
            "f.png": truncated[: len(truncated) // 2],
            "f.txt": b"cut",
            "g.png": bomb_png_bytes(7000, 7000),
            "g.txt": b"big",
        },
    )
    pairs = load_pairs(shard)
    assert [r.key for r in pairs.records] == ["s.tar/a", "s.tar/f"]
    assert pairs.skipped == {"missing_file": 1, "empty_caption": 2, "corrupt_image": 1, "decompression_bomb": 1}
    assert inspect(shard)["skipped"]["corrupt_image"] == 2


def test_not_a_tar_is_a_user_error(tmp_path: Path):
    (tmp_path / "s.tar").write_bytes(b"\x00\x01 not a tar file" * 10)
    with pytest.raises(UserError, match="not a readable"):
        load_pairs(tmp_path / "s.tar")
