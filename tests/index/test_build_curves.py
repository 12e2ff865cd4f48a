"""The recall-against-m curves an index build stores.

``curves.json`` in the version: t2i recall@10 (distinct texts) at every m the index
holds and every power of two, for the run's order, first-m, random and PCA, equal to
``triclip.compact.features.compact_curve`` on the same embeddings; the manifest's recall has a
value for every m (m = 8 had none when it came from the run's evaluation, which measures
only D/16, D/8, D/4); ``--val-data`` measures on that split; ``--add`` carries the curves.
"""

from __future__ import annotations

import json

import pytest
import torch

from triclip.index.sources import CURVES, IndexBuildConfig, build_index, curve_dims, read_curves
from triclip.index.store import current_version, read_manifest
from tests.index.conftest import make_run

DIMS = [4, 8, 16]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from triclip.data.builtin import prepare

    root = tmp_path_factory.mktemp("curves")
    prepare("shapes", str(root / "data"), num=60, seed=3)
    run = make_run(root / "run", seed=0)
    build_index(IndexBuildConfig(run=str(run), data=str(root / "data" / "train.jsonl"), out=str(root / "a"), dims=DIMS))
    build_index(IndexBuildConfig(
        run=str(run), data=str(root / "data" / "train.jsonl"), val_data=str(root / "data" / "val.jsonl"),
        out=str(root / "b"), dims=DIMS,
    ))
    return root, run


def test_curves_cover_every_m_and_the_four_orderings_and_give_the_manifest_its_recall(built):
    root, _ = built
    index = root / "a"
    curves = read_curves(index, current_version(index))
    assert curves["split"] == "indexed" and curves["ordering"] == "importance" and curves["metric"] == "t2i_r10"
    assert curves["dims"] == curve_dims(DIMS + [32], 32) == [2, 4, 8, 16, 32]
    assert set(curves["curves"]) == {"importance", "first", "random", "pca"}
    for by_m in curves["curves"].values():
        assert set(by_m) == {str(m) for m in curves["dims"]} and all(0.0 <= v <= 1.0 for v in by_m.values())
    manifest = read_manifest(index)
    assert set(manifest["recall"]) == {"4", "8", "16", "32"} and None not in manifest["recall"].values()
    assert manifest["recall"] == {m: curves["curves"]["importance"][m] for m in manifest["recall"]}
    assert manifest["recall_source"].startswith(CURVES)


def test_curves_equal_compact_curve_on_the_validation_split(built):
    from triclip.compact.features import compact_curve
    from triclip.data import load_pairs
    from triclip.model.embed import embed_pairs
    from triclip.model.run import load_run

    root, run = built
    curves = read_curves(root / "b", current_version(root / "b"))
    assert curves["split"] == "validation" and curves["data"] == str(root / "data" / "val.jsonl")
    model, _ = load_run(str(run), torch.device("cpu"))
    pairs = load_pairs(str(root / "data" / "val.jsonl"))
    image, text, owner, keep, _ = embed_pairs(model, pairs, torch.device("cpu"), 64)
    texts = [c for i in keep.tolist() for c in pairs.records[i].captions]
    want = compact_curve(image, text, owner, model.importance().detach(), curves["dims"], texts=texts)
    for name, by_m in want.items():
        assert curves["curves"][name] == pytest.approx({str(m): v for m, v in by_m.items()}, abs=1e-4)
    assert curves["queries"] == len(set(texts))


def test_add_carries_the_curves_and_the_file_is_written_with_the_version(built, tmp_path):
    import shutil

    root, run = built
    index = tmp_path / "b"
    shutil.copytree(root / "b", index)
    before = read_curves(index, current_version(index))
    lines = (root / "data" / "train.jsonl").read_text().splitlines()
    extra = root / "data" / "extra.jsonl"
    extra.write_text("\n".join(lines[:5] + [json.dumps({"image": "images/000001.png", "captions": ["a new caption"]})]) + "\n")
    build_index(IndexBuildConfig(run=str(run), data=str(extra), out=str(index), add=True))
    version = current_version(index)
    assert version == "v000002" and read_curves(index, version) == before
    assert read_manifest(index)["recall"] == {m: before["curves"]["importance"][m] for m in ("4", "8", "16", "32")}
    assert not [p for p in index.iterdir() if p.name.startswith(".tmp-")]  # the staged curves file was moved in


def test_a_split_folder_indexes_every_split_with_curves_on_its_validation(built):
    """``index build --data DIR`` (a data split folder) holds every image of all its
    splits, and its curves are measured on DIR/val.jsonl."""
    from triclip.data import load_pairs
    from triclip.data.split import load_collection, split_manifests

    root, run = built
    data = root / "data"
    summary = build_index(IndexBuildConfig(run=str(run), data=str(data), out=str(root / "all"), dims=DIMS))
    manifests = split_manifests(data)
    assert [m.rsplit("/", 1)[-1] for m in manifests][:2] == ["train.jsonl", "val.jsonl"]
    per_split = [load_pairs(m) for m in manifests]
    assert summary["count"] == sum(len(p) for p in per_split) > len(per_split[0])
    everything = {r.image.path for p in per_split for r in p.records}
    assert {r.image.path for r in load_collection(str(data)).records} == everything
    curves = read_curves(root / "all", current_version(root / "all"))
    assert curves["split"] == "validation" and curves["data"] == str(data / "val.jsonl")
    assert load_collection(str(data / "train.jsonl")).fingerprint == per_split[0].fingerprint  # a file: as before
