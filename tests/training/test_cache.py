"""Locked-tower caches hold exactly what the towers compute, in record order."""

from pathlib import Path

import pytest
import torch

from triclip.data import load_pairs
from triclip.model.model import ModelConfig, build_model
from triclip.model.cache import image_tower_outputs, text_tower_outputs


def test_caches_equal_the_towers_and_are_reused(shapes_data, tmp_path):
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset="tiny", embed_dim=16)).eval()
    pairs = load_pairs(str(shapes_data / "val.jsonl"))
    text = text_tower_outputs(model, pairs, "cpu", batch_size=7)  # several uneven batches, sorted by length
    captions = [c for r in pairs.records for c in r.captions]
    with torch.no_grad():
        direct = model.text_features(model.tokenize(captions))
    torch.testing.assert_close(text["features"], direct, rtol=1e-4, atol=1e-5)
    assert text["offsets"][-1] == len(captions)

    image = image_tower_outputs(model, pairs, "cpu", batch_size=5)
    transform = model.image_transform()
    with torch.no_grad():
        direct = model.image_features(torch.stack([transform(r.open_image()) for r in pairs.records]))
    torch.testing.assert_close(image["features"], direct, rtol=1e-4, atol=1e-5)
    assert bool(image["valid"].all())

    files = sorted((tmp_path / "cache" / "features").iterdir())
    assert len(files) == 2
    stamp = [f.stat().st_mtime_ns for f in files]
    image_tower_outputs(model, pairs, "cpu")
    text_tower_outputs(model, pairs, "cpu")
    assert [f.stat().st_mtime_ns for f in files] == stamp  # read, not rewritten


def test_text_cache_key_includes_the_caption_length_cap(shapes_data, tmp_path):
    pairs = load_pairs(str(shapes_data / "val.jsonl"))
    outputs = {}
    for cap in (4, 64):
        model = build_model(ModelConfig(preset="lite", embed_dim=8, text_max_length=cap)).eval()
        outputs[cap] = text_tower_outputs(model, pairs, "cpu")["features"]
    assert len(list((tmp_path / "cache" / "features").iterdir())) == 2  # one file per cap, no stale read
    assert not torch.allclose(outputs[4], outputs[64])  # 4 tokens cut the shapes captions short


def test_a_repeated_caption_runs_through_the_tower_once(shapes_data):
    from triclip.model.accel import distinct_texts

    torch.manual_seed(0)
    model = build_model(ModelConfig(preset="tiny", embed_dim=16)).eval()
    pairs = load_pairs(str(shapes_data / "val.jsonl"))
    captions = [c for r in pairs.records for c in r.captions]
    distinct, inverse = distinct_texts(captions)
    assert [distinct[i] for i in inverse.tolist()] == captions
    assert len(distinct) == len(set(captions)) < len(captions)  # shapes repeats its captions
    rows_run = []
    tower_features = model.text_features

    def counted(tokens):
        out = tower_features(tokens)
        rows_run.append(len(out))
        return out

    model.text_features = counted
    text = text_tower_outputs(model, pairs, "cpu", batch_size=7)
    assert sum(rows_run) == len(distinct)
    with torch.no_grad():
        direct = tower_features(model.tokenize(captions))  # every caption, repeats included
    torch.testing.assert_close(text["features"], direct, rtol=1e-4, atol=1e-5)
    for caption in set(captions):  # a repeat's row is its first occurrence's, bit for bit
        rows = text["features"][[i for i, c in enumerate(captions) if c == caption]]
        assert torch.equal(rows, rows[:1].expand_as(rows))


def test_a_tower_hash_is_remembered_until_its_weights_change(monkeypatch):
    import copy
    import hashlib

    from triclip.model import accel, cache

    torch.manual_seed(0)
    tower = build_model(ModelConfig(preset="tiny", embed_dim=16)).image_tower
    first = cache.module_hash(tower)
    digests, sha256 = [], hashlib.sha256
    monkeypatch.setattr(accel.hashlib, "sha256", lambda: digests.append(1) or sha256())
    assert cache.module_hash(tower) == first and not digests  # remembered: nothing hashed again
    twin = copy.deepcopy(tower)
    assert cache.module_hash(twin) == first and len(digests) == 1  # another module: hashed, same bytes
    with torch.no_grad():
        next(tower.parameters()).add_(1.0)  # an optimizer step or a load, in place
    changed = cache.module_hash(tower)
    assert changed != first and len(digests) == 2
    tower.load_state_dict(twin.state_dict())  # back to the old bytes, in place
    assert cache.module_hash(tower) == first and len(digests) == 3


def test_an_image_pass_on_two_threads_equals_one_thread_bit_for_bit_with_bad_images(tmp_path):
    """cache.image_tower_pass: two threads each decoding a batch for a single-threaded tower give one thread's
    batches, in order, features bit for bit, and the same skipped records (a batch with no good image too)."""
    import os

    from triclip.data import PairDataset
    from triclip.data.builtin import prepare
    from triclip.model.cache import image_tower_pass

    prepare("shapes", str(tmp_path / "data"), num=60, seed=0)
    pairs = load_pairs(str(tmp_path / "data" / "train.jsonl"))
    for record in pairs.records[4:8] + pairs.records[10:11]:  # the second batch of 4 has no image left
        os.remove(record.image.path)
    model = build_model(ModelConfig(preset="lite", embed_dim=8)).eval()
    runs = {}
    for threads in (1, 2):
        dataset = PairDataset(pairs, model.image_transform(train=False), train=False)
        runs[threads] = (list(image_tower_pass(model, dataset, "cpu", 4, threads=threads)), dataset.skipped)
    (one, skipped_one), (two, skipped_two) = runs[1], runs[2]
    assert len(one) == len(two) == -(-len(pairs.records) // 4) - 1  # every batch but the empty one
    for (idx_a, feats_a), (idx_b, feats_b) in zip(one, two):
        assert torch.equal(idx_a, idx_b) and torch.equal(feats_a, feats_b)
    assert skipped_one == skipped_two and sum(skipped_two.values()) == 5
    assert 10 not in torch.cat([idx for idx, _ in two]).tolist()


def test_the_text_cache_on_two_threads_equals_one_thread_bit_for_bit(shapes_data, tmp_path, monkeypatch, capsys):
    from triclip.model import accel

    pairs = load_pairs(str(shapes_data / "train.jsonl"))
    model = build_model(ModelConfig(preset="lite", embed_dim=8)).eval()
    outputs, calls = {}, []
    for threads in (1, 2):
        monkeypatch.setenv("TRICLIP_CACHE", str(tmp_path / f"cache{threads}"))
        monkeypatch.setattr(accel, "pass_threads", lambda tower, device, n=threads: calls.append(n) or n)
        outputs[threads] = text_tower_outputs(model, pairs, "cpu", batch_size=8)  # several batches
    assert calls == [1, 2]
    done = [line for line in capsys.readouterr().err.splitlines() if "caching locked text tower" in line and "(100%)" in line]
    assert len(done) == 2  # each pass ends its progress with a summary line
    assert torch.equal(outputs[1]["features"], outputs[2]["features"])
    assert torch.equal(outputs[1]["offsets"], outputs[2]["offsets"])
    if accel.onnxruntime_available():
        assert set(accel._PREPARED[model.text_tower]) == {0, 1}  # torch's threads, then single-threaded sessions


def _copied(shapes_data, tmp_path):
    """The shapes val split copied to ``tmp_path / "data"`` (its images are deleted by the tests below)."""
    import shutil

    return Path(shutil.copytree(shapes_data, tmp_path / "data"))


def test_no_image_decoded_names_the_first_file_and_why(shapes_data, tmp_path):
    from triclip.core.errors import UserError
    from triclip.model.embed import embed_records

    data = _copied(shapes_data, tmp_path)
    pairs = load_pairs(str(data / "val.jsonl"))  # every header read here
    for record in pairs.records:  # then the images go before any is decoded
        Path(record.path).unlink(missing_ok=True)
    model = build_model(ModelConfig(preset="tiny", embed_dim=16)).eval()
    first = pairs.records[0].path
    for run in (lambda: image_tower_outputs(model, pairs, "cpu"), lambda: embed_records(model, pairs, "cpu")):
        with pytest.raises(UserError) as err:
            run()
        message = str(err.value)
        assert f"skipped: {{'missing_file': {len(pairs)}}}" in message
        assert message.endswith(f"; the first: {first}: No such file or directory")


def test_first_failure_says_when_the_image_decodes_when_tried_again(shapes_data, tmp_path):
    from triclip.data import PairDataset
    from triclip.data.reasons import REASONS

    pairs = load_pairs(str(_copied(shapes_data, tmp_path) / "val.jsonl"))
    dataset = PairDataset(pairs, train=False)
    assert dataset.first_failure() is None
    dataset._bad[2] = REASONS.index("missing_file") + 1  # failed during a pass, there again now
    assert dataset.first_failure() == f"{pairs.records[2].path}: decodes when tried again (it failed during the pass)"
