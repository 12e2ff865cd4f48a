"""Content splits: shares, determinism, merging byte-identical images, every source format."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest

from triclip.data import DataConfig, load_pairs
from triclip.data.split import (
    SPLITS,
    SplitConfig,
    apportion,
    assign_splits,
    check_shares,
    merge_captions,
    split_source,
)
from triclip.core.errors import UserError
from tests.data.data_fixtures import image_bytes, write_image, write_manifest, write_tar, write_truncated_png


def _colour(i: int) -> tuple[int, int, int]:
    return (i % 256, (7 * i) % 256, (13 * i + i // 256) % 256)


def _rows(folder: Path) -> dict[str, list[dict]]:
    return {
        split: [json.loads(line) for line in (folder / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()]
        for split in SPLITS
    }


def _image_hashes(folder: Path) -> dict[str, list[str]]:
    """sha256 of every image file each split's manifest points at (paths relative to the manifest)."""
    return {
        split: [hashlib.sha256((folder / row["image"]).read_bytes()).hexdigest() for row in rows]
        for split, rows in _rows(folder).items()
    }


def _assert_disjoint(folder: Path) -> None:
    hashes = _image_hashes(folder)
    for split in SPLITS:
        assert len(set(hashes[split])) == len(hashes[split]), f"a repeated image in {split}"
    for i, a in enumerate(SPLITS):
        for b in SPLITS[i + 1 :]:
            assert not set(hashes[a]) & set(hashes[b]), f"image bytes in both {a} and {b}"


# ---------------------------------------------------------------------------- shares and ranking


def test_apportion_adds_up_and_stays_within_one_of_each_share():
    for n in [0, 1, 2, 3, 7, 10, 99, 1000, 12345]:
        for val, test in [(0.1, 0.1), (0.15, 0.05), (0.0, 0.3), (0.333, 0.333), (0.0, 0.0), (0.49, 0.5)]:
            shares = SplitConfig(val=val, test=test).shares
            counts = apportion(n, shares)
            assert sum(counts.values()) == n
            assert all(abs(counts[s] - n * shares[s]) < 1 for s in shares), (n, counts)
    assert apportion(10, {"train": 0.8, "val": 0.1, "test": 0.1}) == {"train": 8, "val": 1, "test": 1}
    assert apportion(5, {"train": 0.8, "val": 0.1, "test": 0.1}) == {"train": 4, "val": 1, "test": 0}  # tie: first


def test_assign_splits_exact_counts_deterministic_and_independent_of_order():
    digests = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(1000)]
    config = SplitConfig(val=0.15, test=0.05, seed=3)
    splits = assign_splits(digests, config)
    assert [splits.count(s) for s in SPLITS] == [800, 150, 50]
    assert assign_splits(digests, config) == splits
    reordered = digests[::-1]
    assert dict(zip(reordered, assign_splits(reordered, config))) == dict(zip(digests, splits))
    other = assign_splits(digests, SplitConfig(val=0.15, test=0.05, seed=4))
    assert 100 < sum(a != b for a, b in zip(splits, other))  # another seed, another split
    with pytest.raises(ValueError, match="distinct"):
        assign_splits(digests[:2] + digests[:1], config)


def test_a_larger_test_share_keeps_the_smaller_ones_test_images():
    digests = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(500)]
    small = assign_splits(digests, SplitConfig(val=0.1, test=0.1))
    large = assign_splits(digests, SplitConfig(val=0.1, test=0.2))
    assert {d for d, s in zip(digests, small) if s == "test"} < {d for d, s in zip(digests, large) if s == "test"}


@pytest.mark.parametrize(
    "val, test, message",
    [
        (-0.1, 0.1, "--val must be >= 0"),
        (0.1, -0.01, "--test must be >= 0"),
        (0.5, 0.5, "below 1"),
        (0.9, 0.2, "below 1"),
        (1.0, 0.0, "below 1"),
        (math.nan, 0.1, "--val must be a finite number"),
        (0.1, math.inf, "--test must be a finite number"),
        ("0.1", 0.1, "--val must be a finite number"),
        (True, 0.1, "--val must be a finite number"),
    ],
)
def test_bad_shares_are_user_errors(val, test, message):
    with pytest.raises(UserError, match=message):
        check_shares(val, test)
    with pytest.raises(UserError, match=message):
        SplitConfig(val=val, test=test)


def test_merge_captions_keeps_first_seen_order_once_each():
    assert merge_captions([["b", "a"], ["a", "c", ""], [], ["b", "d"]]) == ["b", "a", "c", "d"]


# ---------------------------------------------------------------------------- JSONL


def _jsonl_source(tmp_path: Path, n: int = 40) -> Path:
    """``n`` distinct images, two byte-identical copies of image 0 and one of image 1, and bad records."""
    src = tmp_path / "src"
    rows = []
    for i in range(n):
        write_image(src / "img" / f"{i:03d}.png", _colour(i))
        rows.append({"image": f"img/{i:03d}.png", "captions": [f"picture {i}", "shared words"], "label": i % 3})
    (src / "copies").mkdir()
    for name, of in (("a.png", 0), ("b.png", 0), ("c.png", 1)):
        (src / "copies" / name).write_bytes((src / "img" / f"{of:03d}.png").read_bytes())
    rows += [
        {"image": "copies/a.png", "captions": ["copy A of zero", "picture 0"], "label": 0},
        {"image": "copies/b.png", "captions": ["copy B of zero"], "label": "other"},
        {"image": "copies/c.png", "captions": ["copy of one"], "label": 1},
        {"image": "missing.png", "captions": ["gone"]},
        {"image": "img/000.png", "captions": [""]},
    ]
    write_truncated_png(src / "broken.png")
    rows.append({"image": "broken.png", "captions": ["truncated"]})
    return write_manifest(src / "all.jsonl", rows)


def test_jsonl_split_merges_copies_and_leaves_no_image_in_two_splits(tmp_path: Path):
    summary = split_source(_jsonl_source(tmp_path), tmp_path / "out", config=SplitConfig(val=0.1, test=0.1))
    assert summary["records"] == 43 and summary["images"] == 40 and summary["duplicates_merged"] == 3
    assert [summary[s] for s in SPLITS] == [32, 4, 4]
    assert summary["skipped"] == {"corrupt_image": 1, "empty_caption": 1, "missing_file": 1}
    assert summary["label_conflicts"] == 1 and summary["images_written"] == 0
    _assert_disjoint(tmp_path / "out")
    rows = {row["image"]: row for split in _rows(tmp_path / "out").values() for row in split}
    assert rows["../src/img/000.png"]["captions"] == ["picture 0", "shared words", "copy A of zero", "copy B of zero"]
    assert rows["../src/img/000.png"]["label"] == 0  # the first copy's
    assert rows["../src/img/001.png"]["captions"] == ["picture 1", "shared words", "copy of one"]
    assert not any("copies/" in image for image in rows)
    for split in SPLITS:  # what every other command reads
        pairs = load_pairs(tmp_path / "out" / f"{split}.jsonl")
        assert not pairs.skipped and len(pairs) == summary[split]


def test_same_seed_same_files_other_seed_other_split(tmp_path: Path):
    source = _jsonl_source(tmp_path)
    split_source(source, tmp_path / "a", config=SplitConfig(seed=7))
    split_source(source, tmp_path / "b", config=SplitConfig(seed=7))
    split_source(source, tmp_path / "c", config=SplitConfig(seed=8))
    for split in SPLITS:
        assert (tmp_path / "a" / f"{split}.jsonl").read_bytes() == (tmp_path / "b" / f"{split}.jsonl").read_bytes()
    assert _rows(tmp_path / "a")["val"] != _rows(tmp_path / "c")["val"]


def test_shares_are_honoured_within_rounding(tmp_path: Path):
    source = _jsonl_source(tmp_path, n=97)
    for val, test in [(0.15, 0.05), (0.0, 0.25), (0.3, 0.0), (0.0, 0.0)]:
        out = tmp_path / f"out-{val}-{test}"
        summary = split_source(source, out, config=SplitConfig(val=val, test=test))
        assert sum(summary[s] for s in SPLITS) == 97
        for split, share in summary["shares"].items():
            assert abs(summary[split] - 97 * share) < 1
            assert len(_rows(out)[split]) == summary[split]


def test_too_few_images_for_train_and_nothing_usable(tmp_path: Path):
    write_image(tmp_path / "a.png")
    one = write_manifest(tmp_path / "one.jsonl", [{"image": "a.png", "captions": ["only"]}])
    with pytest.raises(UserError, match="too few to split"):
        split_source(one, tmp_path / "out1", config=SplitConfig(val=0.45, test=0.45))
    write_truncated_png(tmp_path / "bad.png")
    bad = write_manifest(tmp_path / "bad.jsonl", [{"image": "bad.png", "captions": ["broken"]}])
    with pytest.raises(UserError, match="no usable records.*corrupt_image"):
        split_source(bad, tmp_path / "out2")


def test_output_folder_rules(tmp_path: Path):
    source = _jsonl_source(tmp_path)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(UserError, match="refusing"):
        split_source(source, tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    split_source(source, tmp_path / "out")
    with pytest.raises(UserError, match="--overwrite"):
        split_source(source, tmp_path / "out", config=SplitConfig(seed=1))
    before = (tmp_path / "out" / "val.jsonl").read_bytes()
    split_source(source, tmp_path / "out", config=SplitConfig(seed=1), overwrite=True)
    assert (tmp_path / "out" / "val.jsonl").read_bytes() != before


# ---------------------------------------------------------------------------- CSV, HF, WebDataset


def test_csv_source_with_custom_columns_and_separator(tmp_path: Path):
    lines = ["path;text;kind"]
    for i in range(20):
        write_image(tmp_path / "pics" / f"{i}.jpg", _colour(10 * i))
        lines.append(f"pics/{i}.jpg;photo {i};k{i % 2}")
    (tmp_path / "pics" / "copy.jpg").write_bytes((tmp_path / "pics" / "3.jpg").read_bytes())
    lines += ["pics/copy.jpg;another photo of three;k1", "pics/3.jpg;photo 3 again;k1", "pics/x.jpg"]
    (tmp_path / "d.csv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    data = DataConfig(image_key="path", caption_key="text", label_key="kind", sep=";")
    summary = split_source(tmp_path / "d.csv", tmp_path / "out", data, SplitConfig(val=0.1, test=0.1))
    assert summary["images"] == 20 and summary["duplicates_merged"] == 1 and summary["skipped"] == {"bad_row": 1}
    assert [summary[s] for s in SPLITS] == [16, 2, 2]
    _assert_disjoint(tmp_path / "out")
    rows = {row["image"]: row for split in _rows(tmp_path / "out").values() for row in split}
    assert rows["../pics/3.jpg"] == {
        "image": "../pics/3.jpg", "captions": ["photo 3", "photo 3 again", "another photo of three"], "label": "k1"
    }


def test_hf_dataset_with_image_bytes_is_written_under_images(tmp_path: Path):
    import datasets
    from PIL import Image

    images = [Image.new("RGB", (10, 8), _colour(i)) for i in range(30)] + [Image.new("RGB", (10, 8), _colour(4))]
    texts = [f"square {i}" for i in range(30)] + ["the fourth square again"]
    features = datasets.Features({"image": datasets.Image(), "text": datasets.Value("string")})
    datasets.Dataset.from_dict({"image": images, "text": texts}, features=features).save_to_disk(str(tmp_path / "ds"))
    summary = split_source(tmp_path / "ds", tmp_path / "out")
    assert summary["images"] == 30 and summary["duplicates_merged"] == 1 and summary["images_written"] == 30
    assert [summary[s] for s in SPLITS] == [24, 3, 3]
    _assert_disjoint(tmp_path / "out")
    written = sorted(p.name for p in (tmp_path / "out" / "images").iterdir())
    assert len(written) == 30 and all(name.endswith(".png") for name in written)
    rows = [row for split in _rows(tmp_path / "out").values() for row in split]
    for row in rows:  # named by the hash of the bytes they hold
        digest = hashlib.sha256((tmp_path / "out" / row["image"]).read_bytes()).hexdigest()
        assert Path(row["image"]).stem == digest[:24]
    assert ["square 4", "the fourth square again"] in [row["captions"] for row in rows]


def test_webdataset_shards_are_written_under_images(tmp_path: Path):
    members = {}
    for i in range(25):
        members[f"s/{i:04d}.jpg"] = image_bytes(_colour(9 * i), fmt="JPEG")
        members[f"s/{i:04d}.txt"] = f"caption {i}".encode()
        members[f"s/{i:04d}.cls"] = str(i % 2).encode()
    members["s/9999.jpg"], members["s/9999.txt"] = members["s/0002.jpg"], b"also two"
    members["s/8888.txt"] = b"no image"
    (tmp_path / "shards").mkdir()
    write_tar(tmp_path / "shards" / "a-000.tar", members)
    summary = split_source(tmp_path / "shards", tmp_path / "out", config=SplitConfig(val=0.2, test=0.2, seed=5))
    assert summary["images"] == 25 and summary["duplicates_merged"] == 1 and summary["images_written"] == 25
    assert summary["skipped"] == {"missing_file": 1}
    assert [summary[s] for s in SPLITS] == [15, 5, 5]
    _assert_disjoint(tmp_path / "out")
    rows = [row for split in _rows(tmp_path / "out").values() for row in split]
    assert all(row["image"].startswith("images/") and row["image"].endswith(".jpg") for row in rows)
    assert {"caption 2", "also two"} == set(next(r["captions"] for r in rows if "also two" in r["captions"]))
    assert sorted(row["label"] for row in rows).count(1) == 12
