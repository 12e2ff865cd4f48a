"""Hostile data: every kind is a counted skip, never a crash or a hang."""

from __future__ import annotations

import io
import os
import signal
import socket
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from triclip.app.cli import main as cli_main
from triclip.data import BadRecord, DataConfig, FileImage, decode_image, inspect, load_pairs, probe_image
from triclip.data.images import to_rgb
from triclip.data.reasons import REASONS, count_by_reason
from triclip.data.tabular import MAX_FIELD_CHARS
from triclip.core.errors import UserError
from tests.data.data_fixtures import image_bytes, write_image, write_manifest, write_tar, write_truncated_png

posix_only = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs and SIGALRM")


class Hung(Exception):
    """Not an OSError (as TimeoutError is), so no ``except OSError`` in the code under test can swallow it."""


@contextmanager
def no_hang(seconds: int = 20):
    """Fail (instead of blocking the suite forever) if the body takes longer than ``seconds``."""

    def expire(signum, frame):
        raise Hung(f"hung for {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# ---------------------------------------------------------------------------- CSV / TSV


def test_csv_field_over_128_kib_skips_only_that_row(tmp_path: Path):
    write_image(tmp_path / "a.png")
    write_image(tmp_path / "b.png")
    write_image(tmp_path / "c.png")
    big = "x" * 200_000
    (tmp_path / "d.csv").write_text(
        f'filepath,title\na.png,first\nb.png,{big}\nc.png,"{big}"\nc.png,third\n', encoding="utf-8"
    )
    pairs = load_pairs(tmp_path / "d.csv")
    assert [(r.key, r.captions) for r in pairs.records] == [("a.png", ["first"]), ("c.png", ["third"])]
    assert pairs.skipped == {"bad_row": 2}
    assert MAX_FIELD_CHARS == 128 * 1024


def test_csv_stray_quote_skips_one_row_and_keeps_the_rest(tmp_path: Path):
    for name in "abcde":
        write_image(tmp_path / f"{name}.png")
    (tmp_path / "d.csv").write_text(
        "filepath,title\n"
        "a.png,good\n"
        'b.png,"unterminated quote\n'  # swallows the lines after it until csv gives up
        "c.png,kept\n"
        "lonely\n"  # swallowed, then read again once: one bad_row
        'd.png,"Quoted" then more\n'  # text after a closing quote: read as pandas does
        'e.png,"a caption\nover two lines"\n'  # valid CSV: one row
        'a.png,"opens\nb.png,"closes" and glues two rows\n'  # strict parsing refuses to glue them
        "b.png,last\n",
        encoding="utf-8",
    )
    pairs = load_pairs(tmp_path / "d.csv")
    assert {r.key: r.captions for r in pairs.records} == {
        "a.png": ["good"],
        "c.png": ["kept"],
        "d.png": ["Quoted then more"],
        "e.png": ["a caption over two lines"],
        "b.png": ["closes and glues two rows", "last"],
    }
    assert pairs.skipped == {"bad_row": 3}


def test_stray_quote_on_the_last_row_is_a_bad_row(tmp_path: Path):
    write_image(tmp_path / "a.png")
    (tmp_path / "d.csv").write_text('filepath,title\na.png,fine\na.png,"never closed\n', encoding="utf-8")
    pairs = load_pairs(tmp_path / "d.csv")
    assert [r.captions for r in pairs.records] == [["fine"]]  # not "never closed\n" glued on
    assert pairs.skipped == {"bad_row": 1}


def test_multi_character_separator_is_one_line_user_error(tmp_path: Path, capsys):
    with pytest.raises(UserError, match="--sep must be one character"):
        DataConfig(sep=";;")
    for bad in ('"', "\n", ""):
        with pytest.raises(UserError):
            DataConfig(sep=bad)
    write_image(tmp_path / "a.png")
    (tmp_path / "d.csv").write_text("filepath,title\na.png,x\n", encoding="utf-8")
    assert cli_main(["data", "inspect", str(tmp_path / "d.csv"), "--sep", ";;"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--sep" in err and "Traceback" not in err


def test_backslash_t_separator_means_tab(tmp_path: Path):
    assert DataConfig(sep="\\t").sep == "\t"
    write_image(tmp_path / "a.png")
    (tmp_path / "d.csv").write_text("filepath\ttitle\na.png\ta, b and c\n", encoding="utf-8")
    assert load_pairs(tmp_path / "d.csv", DataConfig(sep="\\t")).records[0].captions == ["a, b and c"]


def test_carriage_returns_only_as_line_ends(tmp_path: Path):
    write_image(tmp_path / "a.png")
    write_image(tmp_path / "b.png")
    (tmp_path / "d.csv").write_bytes(b"filepath,title\ra.png,one\rb.png,two\r")
    assert [r.captions for r in load_pairs(tmp_path / "d.csv").records] == [["one"], ["two"]]


# ---------------------------------------------------------------------------- encodings


@pytest.mark.parametrize("name, sep", [("d.csv", ","), ("d.tsv", "\t")])
def test_utf8_bom_header_is_read(tmp_path: Path, name: str, sep: str):
    write_image(tmp_path / "a.png")
    text = f"filepath{sep}title\r\na.png{sep}bom\r\n"
    (tmp_path / name).write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8"))
    assert load_pairs(tmp_path / name).records[0].captions == ["bom"]


def test_utf8_bom_manifest_is_read(tmp_path: Path):
    write_image(tmp_path / "a.png")
    (tmp_path / "m.jsonl").write_bytes(b'\xef\xbb\xbf{"image": "a.png", "captions": ["bom"]}\n')
    pairs = load_pairs(tmp_path / "m.jsonl")
    assert pairs.records[0].captions == ["bom"] and not pairs.skipped


def test_non_utf8_lines_are_counted_not_read_mangled(tmp_path: Path):
    write_image(tmp_path / "a.png")
    write_image(tmp_path / "caf\xe9.png")
    (tmp_path / "m.jsonl").write_bytes(
        b'{"image": "a.png", "captions": ["ok"]}\n'
        b'{"image": "caf\xe9.png", "captions": ["latin-1 path"]}\n'  # \xe9 alone is not UTF-8
        b'{"image": "a.png", "captions": ["na\xefve"]}\n'
        b'{"image": "a.png", "captions": ["lone \\ud800 surrogate"]}\n'
    )
    pairs = load_pairs(tmp_path / "m.jsonl")
    assert [r.captions for r in pairs.records] == [["ok"]]
    assert pairs.skipped == {"bad_encoding": 3}
    assert len(pairs.fingerprint) == 64  # every kept string encodes
    (tmp_path / "d.csv").write_bytes(b"filepath,title\na.png,ok\na.png,na\xefve\nb.png,\"two\n\xff lines\"\n")
    pairs = load_pairs(tmp_path / "d.csv")
    assert [r.captions for r in pairs.records] == [["ok"]]
    assert pairs.skipped == {"bad_encoding": 2}


def test_non_utf8_webdataset_caption_is_counted(tmp_path: Path):
    shard = write_tar(
        tmp_path / "s.tar",
        {"a.png": image_bytes(), "a.txt": b"\xef\xbb\xbfgood", "b.png": image_bytes(), "b.txt": b"caf\xe9"},
    )
    pairs = load_pairs(shard)
    assert [r.captions for r in pairs.records] == [["good"]]
    assert pairs.skipped == {"bad_encoding": 1}


# ---------------------------------------------------------------------------- paths that are not image files


@posix_only
def test_non_regular_and_broken_image_paths_are_bad_records(tmp_path: Path):
    write_image(tmp_path / "good.png")
    os.mkfifo(tmp_path / "fifo.png")  # opening it for reading would block forever
    (tmp_path / "dir.png").mkdir()
    os.symlink(tmp_path / "loop_b.png", tmp_path / "loop_a.png")
    os.symlink(tmp_path / "loop_a.png", tmp_path / "loop_b.png")
    (tmp_path / "empty.png").write_bytes(b"")
    (tmp_path / "text.png").write_text("hello, I am not an image\n", encoding="utf-8")
    write_truncated_png(tmp_path / "truncated.png")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(tmp_path / "sock.png"))
    rows = [
        {"image": "good.png", "captions": ["fine"]},
        {"image": "fifo.png", "captions": ["fifo"]},
        {"image": "dir.png", "captions": ["directory"]},
        {"image": os.devnull, "captions": ["device"]},
        {"image": "sock.png", "captions": ["socket"]},
        {"image": "go\u0000od.png", "captions": ["nul byte"]},
        {"image": "loop_a.png", "captions": ["symlink loop"]},
        {"image": "empty.png", "captions": ["empty"]},
        {"image": "text.png", "captions": ["text"]},
        {"image": "truncated.png", "captions": ["truncated"]},
    ]
    manifest = write_manifest(tmp_path / "m.jsonl", rows)
    try:
        with no_hang():
            pairs = load_pairs(manifest)
            report = inspect(manifest)
    finally:
        listener.close()
    assert [r.key for r in pairs.records] == ["good.png", "truncated.png"]  # truncation shows at decode time
    assert pairs.skipped == {"not_a_file": 4, "missing_file": 2, "corrupt_image": 2}
    assert report["records"] == 1
    assert report["skipped"] == {"corrupt_image": 3, "missing_file": 2, "not_a_file": 4}


@posix_only
def test_decode_and_dataset_never_block_on_a_fifo(tmp_path: Path):
    from triclip.data import PairDataset

    write_image(tmp_path / "a.png")
    write_image(tmp_path / "b.png")
    rows = [{"image": name, "captions": ["x"]} for name in ("a.png", "b.png")]
    pairs = load_pairs(write_manifest(tmp_path / "m.jsonl", rows))
    (tmp_path / "b.png").unlink()
    os.mkfifo(tmp_path / "b.png")  # swapped for a FIFO after loading
    with no_hang():
        with pytest.raises(BadRecord) as err:
            decode_image(FileImage(str(tmp_path / "b.png")))
        dataset = PairDataset(pairs, train=False)
        items = [dataset[0], dataset[1]]
    assert err.value.reason == "not_a_file" and "FIFO" in str(err.value)
    assert items[0] is not None and items[1] is None
    assert dataset.skipped == {"not_a_file": 1}


@posix_only
def test_webdataset_directory_ignores_a_fifo_shard(tmp_path: Path):
    (tmp_path / "shards").mkdir()
    write_tar(tmp_path / "shards" / "a.tar", {"x.png": image_bytes(), "x.txt": b"cap"})
    os.mkfifo(tmp_path / "shards" / "b.tar")
    with no_hang():
        pairs = load_pairs(tmp_path / "shards")
        with pytest.raises(UserError, match="not a regular file"):
            load_pairs(str(tmp_path / "shards" / "{a,b}.tar"))
    assert [r.key for r in pairs.records] == ["a.tar/x"]


def test_csv_nul_byte_path(tmp_path: Path):
    write_image(tmp_path / "a.png")
    (tmp_path / "d.csv").write_text("filepath,title\na.png,ok\na\x00.png,nul\n", encoding="utf-8")
    pairs = load_pairs(tmp_path / "d.csv")
    assert [r.key for r in pairs.records] == ["a.png"] and pairs.skipped == {"missing_file": 1}


# ---------------------------------------------------------------------------- decoding


def _png(array: np.ndarray, **save) -> bytes:
    out = io.BytesIO()
    Image.fromarray(array).save(out, format="PNG", **save)
    return out.getvalue()


def test_16_bit_png_is_scaled_not_saturated(tmp_path: Path):
    ramp = (np.arange(256, dtype=np.uint16) * 257).reshape(1, 256).repeat(4, axis=0)  # (4, 256): 0..65535
    (tmp_path / "deep.png").write_bytes(_png(ramp))
    assert Image.open(tmp_path / "deep.png").mode.startswith("I")
    rgb = np.asarray(decode_image(FileImage(str(tmp_path / "deep.png"))))  # (4, 256, 3)
    assert rgb.shape == (4, 256, 3) and rgb.dtype == np.uint8
    assert (rgb[0, :, 0] == np.arange(256)).all()  # 257 * v -> v exactly; PIL's convert gives 255 from v = 1 up
    assert (rgb[..., 0] == rgb[..., 2]).all()


@pytest.mark.parametrize(
    "mode, values, expected",
    [
        ("I", [0, 32768, 65535], [0, 128, 255]),
        ("I", [0, 100_000, 200_000], [0, 128, 255]),  # beyond 16 bits: scaled by its maximum
        ("F", [0.0, 0.5, 1.0], [0, 128, 255]),  # floats in [0, 1]
        ("F", [0.0, 128.0, 255.0], [0, 128, 255]),
        ("F", [float("nan"), -5.0, 1.0], [0, 0, 255]),
    ],
)
def test_high_depth_modes_scale_by_their_range(mode: str, values: list, expected: list):
    dtype = np.int32 if mode == "I" else np.float32
    image = Image.fromarray(np.array([values], dtype=dtype), mode=mode)
    assert np.asarray(to_rgb(image))[0, :, 1].tolist() == expected


def _transparent_images() -> dict[str, Image.Image]:
    """Every (value, alpha) pair of 8 bits in RGBA, LA and PA, and the single-colour transparency of P, RGB and L."""
    value, alpha = (a.astype(np.uint8) for a in np.meshgrid(np.arange(256), np.arange(256)))  # (256, 256) each
    rgba = Image.fromarray(np.stack([value, 255 - value, value // 2 + 7, alpha], axis=-1), "RGBA")
    la = Image.fromarray(np.stack([value, alpha], axis=-1), "LA")
    palette = Image.fromarray(value, "L").convert("P")
    pa = Image.merge("PA", (palette, Image.fromarray(alpha, "L")))
    palette.info["transparency"] = 3
    rgb = Image.fromarray(np.stack([value, value, alpha], axis=-1), "RGB")
    rgb.info["transparency"] = (5, 5, 5)
    grey = Image.fromarray(value, "L")
    grey.info["transparency"] = 9
    return {"RGBA": rgba, "LA": la, "PA": pa, "P": palette, "RGB": rgb, "L": grey}


@pytest.mark.parametrize("mode", ["RGBA", "LA", "PA", "P", "RGB", "L"])
def test_transparency_is_composited_on_white_as_pillows_alpha_composite_does(mode: str):
    """``to_rgb`` pastes onto white through the alpha (7x faster on a thumbnail's originals): byte for byte what
    Pillow's ``alpha_composite`` over opaque white gives, at every value and alpha."""
    image = _transparent_images()[mode]
    assert image.mode == mode
    white = Image.new("RGBA", image.size, (255, 255, 255, 255))
    expected = np.asarray(Image.alpha_composite(white, image.convert("RGBA")).convert("RGB"))
    got = np.asarray(to_rgb(image))
    assert got.shape == expected.shape and (got == expected).all()
    assert image.mode == mode and (got == 255).all(axis=-1).any()  # the input untouched; transparent pixels white


def test_a_probed_file_is_not_opened_again_until_it_changes(tmp_path: Path, monkeypatch):
    """A second probe of an unchanged file reads no header; a file rewritten since (another size, another change
    time), or probed under a stricter pixel limit, is probed again."""
    from triclip.data import images

    path = tmp_path / "a.png"
    path.write_bytes(_png(np.zeros((10, 20, 3), dtype=np.uint8)))
    opened = []
    real_open = Image.open
    monkeypatch.setattr(images.Image, "open", lambda *args, **kw: opened.append(1) or real_open(*args, **kw))
    assert [probe_image(FileImage(str(path))) for _ in range(3)] == [(20, 10)] * 3 and len(opened) == 1
    with pytest.raises(BadRecord) as bomb:
        probe_image(FileImage(str(path)), max_pixels=100)
    assert bomb.value.reason == "decompression_bomb" and len(opened) == 2
    path.write_bytes(b"\x89PNG\r\n\x1a\n not a png any more")
    with pytest.raises(BadRecord) as corrupt:
        probe_image(FileImage(str(path)))
    assert corrupt.value.reason == "corrupt_image" and len(opened) == 3
    path.write_bytes(_png(np.zeros((5, 7, 3), dtype=np.uint8)))
    assert probe_image(FileImage(str(path))) == (7, 5) and len(opened) == 4
    path.unlink()
    with pytest.raises(BadRecord) as missing:
        probe_image(FileImage(str(path)))
    assert missing.value.reason == "missing_file"


def test_exif_orientation_is_applied(tmp_path: Path):
    array = np.zeros((10, 20, 3), dtype=np.uint8)  # (H, W, 3): left half red, right half blue
    array[:, :10] = (255, 0, 0)
    array[:, 10:] = (0, 0, 255)
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    (tmp_path / "turned.png").write_bytes(_png(array, exif=exif.tobytes()))
    assert probe_image(FileImage(str(tmp_path / "turned.png"))) == (20, 10)  # as stored
    image = decode_image(FileImage(str(tmp_path / "turned.png")))
    assert image.size == (10, 20)  # upright
    pixels = np.asarray(image)  # (20, 10, 3)
    assert tuple(pixels[2, 5]) == (255, 0, 0) and tuple(pixels[17, 5]) == (0, 0, 255)  # red on top


def test_damaged_exif_keeps_the_image(tmp_path: Path):
    data = _png(np.full((6, 8, 3), 90, dtype=np.uint8), exif=b"Exif\x00\x00MM\x00*garbage")
    (tmp_path / "odd.png").write_bytes(data)
    assert decode_image(FileImage(str(tmp_path / "odd.png"))).size == (8, 6)


# ---------------------------------------------------------------------------- counting


def test_reasons_keep_their_stored_order_and_counts_merge():
    assert REASONS[:5] == ("missing_file", "corrupt_image", "empty_caption", "decompression_bomb", "bad_row")
    assert {"not_a_file", "bad_encoding"} <= set(REASONS)
    merged = count_by_reason(Counter(bad_row=2, not_a_file=1), {"corrupt_image": 3, "bad_row": 1, "missing_file": 0})
    assert merged == {"bad_row": 3, "corrupt_image": 3, "not_a_file": 1}
    assert list(merged) == sorted(merged)


def test_inspect_report_adds_read_and_decode_skips(tmp_path: Path):
    write_image(tmp_path / "a.png")
    write_truncated_png(tmp_path / "t.png")
    manifest = tmp_path / "m.jsonl"
    manifest.write_bytes(
        b'{"image": "a.png", "captions": ["ok"]}\n{"image": "t.png", "captions": ["cut"]}\n'
        b'{"image": "a.png", "captions": ["\xff"]}\nnot json\n'
    )
    assert inspect(manifest)["skipped"] == {"bad_encoding": 1, "bad_row": 1, "corrupt_image": 1}
    manifest.write_text('{"image": "a.png", "captions": ["ok"]}\n' + "[" * 100_000 + "\n", encoding="utf-8")
    assert load_pairs(manifest).skipped == {"bad_row": 1}


# ---------------------------------------------------------------------------- one-line errors of data prepare


def test_prepare_into_an_impossible_folder_is_one_line(tmp_path: Path, capsys):
    (tmp_path / "file").write_text("x", encoding="utf-8")
    out = tmp_path / "file" / "sub"  # a folder under a file: mkdir fails with ENOTDIR
    assert cli_main(["data", "prepare", "shapes", "--out", str(out), "--num", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a file, not a folder" in err and "Not a directory" in err


def test_a_binary_file_named_csv_is_one_short_line(tmp_path: Path):
    (tmp_path / "d.csv").write_bytes(image_bytes(size=(64, 64), noise=True))
    with pytest.raises(UserError) as err:
        load_pairs(tmp_path / "d.csv")
    message = str(err.value)
    assert "no column 'filepath'" in message and len(message) < 400 and message.isprintable()


def test_a_damaged_saved_dataset_is_one_line(tmp_path: Path):
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "state.json").write_text("{garbage", encoding="utf-8")
    with pytest.raises(UserError, match="not a readable datasets.save_to_disk folder") as err:
        load_pairs(tmp_path / "ds")
    assert "\n" not in str(err.value)


def test_big_endian_16_bit_is_scaled():
    image = Image.frombytes("I;16B", (3, 1), np.array([0, 32896, 65535], dtype=">u2").tobytes())
    assert np.asarray(to_rgb(image))[0, :, 0].tolist() == [0, 128, 255]
