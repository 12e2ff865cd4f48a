"""Fixtures for index tests: tiny shapes data and tiny runs saved without training.

A run is a ``tiny`` DualEncoder with a random (seeded) importance, written the way
``triclip.training.checkpoint`` writes runs; an untrained model embeds deterministically, which
is all that build / search / fingerprint tests need, and takes a second instead of a
training run.
"""

from __future__ import annotations

import os

# FAISS's OpenMP threads sleep when idle instead of spinning: on a busy shared CPU, spinning
# makes PQ training here ~10x slower. Read when FAISS's libgomp loads, so set before importing it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from triclip.data.builtin import prepare  # noqa: E402
from triclip.model.model import ModelConfig, build_model  # noqa: E402
from triclip.training import checkpoint as ckpt  # noqa: E402

EMBED_DIM = 32


def make_run(out: Path, seed: int) -> Path:
    """Save an untrained tiny model with a random importance as a run directory."""
    torch.manual_seed(seed)
    cfg = ModelConfig(preset="tiny", embed_dim=EMBED_DIM)
    model = build_model(cfg)
    with torch.no_grad():
        model.theta.copy_(torch.randn(EMBED_DIM) * 2)  # distinct w: a non-trivial importance order
    out.mkdir(parents=True)
    ckpt.save_weights(model, out / ckpt.MODEL)
    ckpt.write_config(out, {"model": cfg.to_dict(), "loss": "tricl"})
    return out


@pytest.fixture(scope="session")
def shapes_dir(tmp_path_factory) -> Path:
    """A small shapes dataset: train.jsonl (~90 images) and val.jsonl."""
    out = tmp_path_factory.mktemp("shapes")
    prepare("shapes", str(out), num=100, seed=0)
    return out


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory) -> Path:
    return make_run(tmp_path_factory.mktemp("runs") / "run_a", seed=0)


@pytest.fixture(scope="session")
def other_run_dir(tmp_path_factory) -> Path:
    return make_run(tmp_path_factory.mktemp("runs") / "run_b", seed=1)


def split_manifest(src: Path, first: Path, second: Path, at: int) -> None:
    """Write the first ``at`` lines of a JSONL manifest to ``first`` and the rest to ``second``.

    Image paths are made absolute so the new manifests can live anywhere.
    """
    rows = [json.loads(line) for line in src.read_text().splitlines() if line.strip()]
    for row in rows:
        row["image"] = str((src.parent / row["image"]).resolve())
    for path, part in ((first, rows[:at]), (second, rows[at:])):
        path.write_text("".join(json.dumps(r) + "\n" for r in part))


def unit_vectors(rng: np.random.Generator, n: int, d: int) -> np.ndarray:
    """``n`` random unit vectors of dimension ``d``, float32."""
    x = rng.standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.fixture(scope="module")
def synthetic():
    """4 shards of unequal size (one empty) of clustered 32-d unit vectors, float16 like a shard file."""
    from triclip.index.vectors import ShardVectors

    rng = np.random.default_rng(0)
    centres = unit_vectors(rng, 40, 32)
    x = centres[rng.integers(0, 40, 3000)] + 0.3 * unit_vectors(rng, 3000, 32)
    x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float16)
    return ShardVectors.of([x[:1100], x[1100:1100], x[1100:2500], x[2500:]])


class GivenLatency:
    """A latency model that times nothing (``triclip.index.latency.LatencyModel``'s interface): each code's query
    takes ``per_byte`` ms per byte of its code (``codes``: ms by codec name instead), a re-rank ``per_candidate``
    ms per candidate (and ``per_read`` ms per candidate read cold from disk: ``reads`` records each count asked;
    a two-stage search timed end to end cold, the sum plus ``cold_extra`` ms: ``cold`` records each), the float32
    scan ``reference`` ms; probes say what the fitted code would."""

    def __init__(self, reference: float = 1.0, per_byte: float = 0.001, per_candidate: float = 0.0,
                 codes: dict | None = None, per_read: float = 0.0, cold_extra: float = 0.0):
        self.reference, self.per_byte, self.per_candidate, self.codes = reference, per_byte, per_candidate, codes or {}
        self.per_read, self.reads = per_read, []
        self.cold_extra, self.cold = cold_extra, []  # ms an end-to-end cold search adds to the sum of its parts

    def ms(self, spec) -> float:
        return self.codes.get(spec.codec, self.per_byte * spec.bytes_per_vector)

    def search(self, codec, queries, k, n, params=None):
        from triclip.index.latency import Latency

        return Latency(self.ms(codec.spec), "given")

    def rerank(self, vectors, queries, count):
        return self.per_candidate * count

    def cold_rows(self, file, count):
        self.reads.append((file, count))
        return self.per_read * count

    def cold_search(self, codes, file, queries, length, k=10, sq8=None):
        self.cold.append((codes.spec.label(), file, length))
        return self.ms(codes.spec) + (self.per_candidate + self.per_read) * length + self.cold_extra

    def float_scan(self, vectors, queries, n):
        from triclip.index.latency import Latency

        return Latency(self.reference, "given")

    def probe(self, spec, sample, n, queries):
        from triclip.index.latency import Latency

        return Latency(self.ms(spec), "given")


@pytest.fixture
def given_latency(monkeypatch):
    """Builds in this test take their latencies from a :class:`GivenLatency` (returned; change its fields)."""
    from triclip.index import budgets

    model = GivenLatency()
    monkeypatch.setattr(budgets, "latency_model", lambda: model)
    return model
