"""scripts/rows_precision.py: the share of the exact top 10 that exact search over float16 and sq8 rows keeps."""

import importlib.util
import json
from pathlib import Path

import faiss
import numpy as np

from benchmarks.vectors_dtype import kept_precisions
from triclip.index.vectors import SQ8Rows, exact_topk

_path = Path(__file__).resolve().parents[2] / "scripts" / "rows_precision.py"
_spec = importlib.util.spec_from_file_location("rows_precision", _path)
rows_precision = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rows_precision)


def _crowded(rng, n: int = 20_000, d: int = 32) -> np.ndarray:
    """Unit rows crowded around a few centres: many near-ties in every top 10, as a large haystack has."""
    centres = rng.standard_normal((8, d))
    x = centres[rng.integers(0, 8, n)] + 0.15 * rng.standard_normal((n, d))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def test_float32_keeps_all_and_the_coarser_rows_keep_less(tmp_path):
    rng = np.random.default_rng(0)
    full = _crowded(rng)
    queries = full[:200] + 0.05 * rng.standard_normal((200, 32)).astype(np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    truth = exact_topk(full, queries, 10)  # (200, 10)
    got = rows_precision.kept_by_precision(full, queries, truth)
    assert got["float32"] == 1.0
    assert 0.5 < got["sq8"] < got["float16"] <= 1.0  # 256 steps of a range move a score more than float16 does


def test_a_haystack_folder_is_read_shard_by_shard_and_printed_as_one_json_line(tmp_path, capsys):
    rng = np.random.default_rng(1)
    full = _crowded(rng, n=3000)
    for s, lo in enumerate((0, 1000, 2500)):  # three shards of unequal size, as embed writes them
        (tmp_path / "embeddings" / f"shard-{s:05d}").mkdir(parents=True)
        np.save(tmp_path / "embeddings" / f"shard-{s:05d}" / "image.npy", full[lo : (1000, 2500, 3000)[s]])
    queries = full[:50]
    np.save(tmp_path / "queries.npy", queries)
    truth = exact_topk(full, queries, 10)  # (50, 10)
    np.save(tmp_path / "truth.npy", truth)
    far = [int(np.argmin(full @ q)) for q in queries]  # a row no top 10 holds
    targets = [[q] if q % 2 == 0 else [far[q]] for q in range(50)]  # half the queries' targets are found
    (tmp_path / "queries.jsonl").write_text("".join(json.dumps({"targets": t}) + "\n" for t in targets))
    assert rows_precision.main([str(tmp_path)]) == 0
    line = json.loads(capsys.readouterr().out)
    assert line["rows"] == 3000 and line["float32"] == 1.0 and line["sq8"] <= line["float16"]
    assert line["recall@10 float32"] == 0.5 and not any(far[q] in truth[q] for q in range(50))
    assert {"recall@10 float16", "recall@10 sq8", "recall@10 sq8 unrotated"} <= set(line)


def test_the_kept_precisions_are_float16_sq8_as_built_and_sq8_without_its_rotation():
    full = _crowded(np.random.default_rng(2), n=2000)
    kept = kept_precisions(full)
    assert list(kept) == ["float16", "sq8", "sq8 unrotated"]
    store = SQ8Rows(np.empty((0, 32), np.uint8), SQ8Rows.fit(full))
    np.testing.assert_array_equal(kept["sq8"], store.decode(store.encode(full)))  # what a build keeps
    plain = faiss.ScalarQuantizer(32, faiss.ScalarQuantizer.QT_8bit)
    plain.train(full)
    np.testing.assert_array_equal(kept["sq8 unrotated"], plain.decode(plain.compute_codes(full)))
    assert not np.allclose(kept["sq8"], kept["sq8 unrotated"])
