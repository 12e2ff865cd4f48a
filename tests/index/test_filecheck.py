"""The file records of a version (``triclip.index.filecheck``) and the codes read on first use (``lazy_codes``).

The fingerprint reads a fixed amount and sees what it samples (and not what lies between: said here, as
the module says it); a codec read back states the spec it was written with (the check of a version written
before the records relies on it); the codes of a budget are read once however many threads ask, a refused
budget holds up no other, and a version's codes stay readable after a writer replaced the version.
"""

from __future__ import annotations

import json
import os
import threading

import numpy as np
import pytest

from tests.index.conftest import split_manifest, unit_vectors
from triclip.core.errors import UserError
from triclip import codecs
from triclip.index import filecheck


def _fingerprint(path) -> str:
    return filecheck.record(path)["sampled_sha256"]


@pytest.mark.parametrize("size", [0, 1, filecheck.WHOLE_MAX, filecheck.WHOLE_MAX + 1, 50 << 20])
def test_the_fingerprint_reads_a_bounded_amount_inside_the_file(size):
    spans = filecheck.spans(size)
    assert all(0 <= offset and offset + length <= size for offset, length in spans)
    assert sum(length for _, length in spans) <= max(min(size, filecheck.WHOLE_MAX),
                                                    2 * filecheck.EDGE + filecheck.BLOCKS * filecheck.BLOCK)
    if size > filecheck.WHOLE_MAX:
        assert spans[0] == (0, filecheck.EDGE) and spans[-1] == (size - filecheck.EDGE, filecheck.EDGE)


def test_the_fingerprint_sees_size_head_tail_and_samples_but_not_bytes_between(tmp_path):
    size = 8 << 20
    data = bytearray(np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes())
    path = tmp_path / "codes"
    path.write_bytes(data)
    base = _fingerprint(path)
    sampled = {filecheck.spans(size)[k][0] + 7 for k in (0, 5, -1)}  # in the head, a middle block, the tail
    for offset in sampled:
        changed = bytearray(data)
        changed[offset] ^= 1
        path.write_bytes(changed)
        assert _fingerprint(path) != base
    path.write_bytes(data[:-1])
    assert _fingerprint(path) != base
    between = filecheck.spans(size)[2][0] - 100  # after block 1, before block 2: not read (the documented limit)
    changed = bytearray(data)
    changed[between] ^= 1
    path.write_bytes(changed)
    assert _fingerprint(path) == base


@pytest.mark.parametrize("spec", [
    codecs.CodecSpec("float32", 8, 32), codecs.CodecSpec("int8", 16, 16), codecs.CodecSpec("binary", 32, 4),
    codecs.CodecSpec("pq", 32, 8, {"M": 8, "nbits": 8}), codecs.CodecSpec("opq", 32, 4, {"M": 4, "nbits": 8}),
    codecs.CodecSpec("rq", 32, 4, {"M": 4, "nbits": 8}), codecs.CodecSpec("mixed", 32, 6, {}),
], ids=lambda s: s.codec)
def test_a_codec_read_back_states_the_spec_it_was_written_with(tmp_path, spec):
    x = unit_vectors(np.random.default_rng(0), 300, 32)
    codec = codecs.fit(spec, x)
    codec.add(x)
    codec.save(tmp_path / "c.codec")
    loaded = codecs.load(tmp_path / "c.codec", 32)
    assert json.dumps(loaded.spec.to_json(), sort_keys=True) == json.dumps(codec.spec.to_json(), sort_keys=True)
    assert (len(loaded), loaded.dim) == (300, 32)


@pytest.fixture(scope="module")
def coded(tmp_path_factory, run_dir, shapes_dir):
    """An index of 40 shapes images with int8 codes at 4 and 8 B; the other records, for an --add."""
    from triclip.index.sources import IndexBuildConfig, build_index

    root = tmp_path_factory.mktemp("coded")
    split_manifest(shapes_dir / "train.jsonl", root / "a.jsonl", root / "b.jsonl", 40)
    build_index(IndexBuildConfig(run=str(run_dir), data=str(root / "a.jsonl"), out=str(root / "index"), dims=[8],
                                 bytes=[4, 8], codec="int8"))  # fmt: skip
    return root


def _copy(coded, tmp_path):
    import shutil

    shutil.copytree(coded / "index", tmp_path / "index")
    return tmp_path / "index"


def test_a_budget_is_read_once_however_many_threads_ask(tmp_path, coded, monkeypatch):
    from triclip.index.store import load_contents

    index = _copy(coded, tmp_path)
    reads, load = [], codecs.load

    def counted(path, dim=None):
        reads.append(path)
        return load(path, dim)

    monkeypatch.setattr(codecs, "load", counted)
    contents = load_contents(index)
    assert reads == [] and sorted(contents.codes) == [4, 8]  # opened, not read
    barrier, got = threading.Barrier(16), []

    def ask():
        barrier.wait()
        got.append(contents.codes[8])

    threads = [threading.Thread(target=ask) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(reads) == 1 and len(got) == 16 and all(codec is got[0] for codec in got)
    assert len(contents.codes[8]) == 40 and len(reads) == 1


def test_a_refused_budget_holds_up_no_other(tmp_path, coded):
    from triclip.index.search import Searcher
    from triclip.index.store import current_version

    index = _copy(coded, tmp_path)
    (index / current_version(index) / "image.b8.codec").write_bytes(b"not codes")
    searcher = Searcher.load(index)
    query = searcher.vectors_of([searcher.contents.meta[0]["id"]])
    for _ in range(2):  # the refusal is kept, and said the same way
        with pytest.raises(UserError, match=r"image\.b8\.codec is 9 bytes, the manifest records"):
            searcher.search_vectors(query, k=3, bytes=8)
    assert len(searcher.search_vectors(query, k=3, bytes=4)[0]) == 3
    assert len(searcher.search_vectors(query, k=3)[0]) == 3


def test_the_codes_of_a_replaced_version_stay_readable(tmp_path, coded, run_dir):
    """The descriptor opened with the version keeps its codes readable after an --add removed the version."""
    from triclip.index.search import Searcher
    from triclip.index.sources import IndexBuildConfig, build_index

    index = _copy(coded, tmp_path)
    searcher = Searcher.load(index)
    first = searcher.contents.version
    query = searcher.vectors_of([searcher.contents.meta[0]["id"]])
    before = searcher.search_vectors(query, k=5, bytes=8)[0]
    build_index(IndexBuildConfig(run=str(run_dir), data=str(coded / "b.jsonl"), out=str(index), add=True))
    assert not (index / first).exists()
    # the same answers from the removed version's codes: the top-1 itself can be a tie on tiny data at 8 B
    assert searcher.search_vectors(query, k=5, bytes=8)[0] == before
    assert searcher.contents.meta[0]["id"] in [hit["id"] for hit in before]
    assert len(Searcher.load(index).contents.codes[8]) > 40  # the new version's codes hold the added rows


def test_a_version_written_by_a_build_records_every_file(coded):
    from triclip.index.store import MANIFEST, current_version

    version = coded / "index" / current_version(coded / "index")
    records = json.loads((version / MANIFEST).read_text())["files"]
    assert sorted(records) == sorted(p.name for p in version.iterdir() if p.name != MANIFEST)
    for name, want in records.items():
        assert filecheck.record(version / name)["sampled_sha256"] == want["sampled_sha256"]
        assert want["size"] == os.path.getsize(version / name)
    assert records["image.b8.codec"]["codec"]["codec"] == "int8" and records["image.b8.codec"]["count"] == 40


def test_curves_that_are_not_the_recorded_file_are_not_drawn(tmp_path, coded):
    from triclip.index.manifest import CURVES, read_curves
    from triclip.index.store import MANIFEST, current_version

    index = _copy(coded, tmp_path)
    version = current_version(index)
    records = json.loads((index / version / MANIFEST).read_text())["files"]
    assert read_curves(index, version, records) is not None
    curves = json.loads((index / version / CURVES).read_text())
    curves["ordering"] = "random"  # another file: the panel would draw another ordering's curve as this index's
    (index / version / CURVES).write_text(json.dumps(curves))
    assert read_curves(index, version, records) is None
    assert read_curves(index, version) is not None  # without records (a version written before them): read
