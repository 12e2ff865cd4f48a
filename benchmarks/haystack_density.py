"""Distractor vectors for a haystack of any size: drawn between a collection's vectors and their neighbours.

A draw picks a fitted vector x_c at random, one of its k nearest fitted vectors x_j at random, a
t ~ U(t_min, t_max), and returns ``normalize((1 - t) x_c + t x_j)``: a point on the way from a real vector
toward one of its real neighbours, nearer its own (t_max <= 0.5). Two numbers are calibrated on held-out
real vectors that were not fitted (:func:`calibrate`):

- t_min, so draws are near-copies (cosine > ``near`` to a fitted vector) exactly as often as held-out real
  vectors are. This is what "not near-copies" means here: a fresh real image of the same collection lies
  within cosine 0.95 of some fitted image at a measured rate (about 0.32 on the demo's images: clip-art has
  many re-coloured variants), and draws do so at that rate, not more. No draw copies a fitted vector:
  t >= t_min > 0 moves every draw off it, and the share of draws above 0.95 is pinned to the real share.
- k, so held-out queries find their held-out targets among as many draws as there are fitted vectors as often
  (recall@10) as among the fitted vectors themselves.

Kernel densities fitted the same way (isotropic, local low-rank, a 64-component full-covariance GMM) were
too easy at the spread where draws sit as far from the fitted vectors as held-out ones do, and near-copies at
the spread where recall matched. Sampling is streamed: row i depends on (seed, i) only, never on the chunk
size or on n (:func:`rows` regenerates any rows by number). Torch-free (numpy and FAISS).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Iterator

import faiss
import numpy as np

BLOCK = 65_536  # rows per random stream: block b of (seed s, side) comes from default_rng([s, STREAM + side, b])
STREAM = 0x4A7  # separates these streams from other uses of the same seed


@dataclass
class DensityConfig:
    """How a density is fitted and calibrated."""

    max_partners: int = 1024  # nearest fitted vectors found per fitted vector; the calibration uses the first k
    partner_grid: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024)  # k tried by the calibration
    t_max: float = 0.5  # a draw lies at most this far toward its partner (0.5: nearer its own vector)
    near: float = 0.95  # cosine above which a vector is a near-copy of another
    seeds: int = 3  # haystacks averaged per k in the recall calibration
    k_recall: int = 10  # recall@k_recall is matched
    steps: int = 12  # bisection steps for t_min


@dataclass
class Model:
    """A fitted density (:func:`save` writes it as .npz)."""

    centres: np.ndarray  # (C, D) float32 the fitted vectors, unit rows
    partners: np.ndarray  # (C, K) int32 each one's nearest other fitted vectors, nearest first
    k: float  # partners used: rank floor(u * k) of the K, u ~ U(0, 1)
    t_min: float  # a draw sits at t ~ U(t_min, t_max) toward its partner
    t_max: float
    calibration: dict = field(default_factory=dict)  # what the calibration measured (held-out and draws)


def normalize(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def fit(vectors: np.ndarray, cfg: DensityConfig = DensityConfig()) -> Model:
    """The density of (N, D) unit vectors before calibration (k = max_partners, t_min = 0)."""
    x = np.ascontiguousarray(vectors, np.float32)
    if x.ndim != 2 or len(x) < 3:
        raise ValueError(f"need at least 3 vectors (N, D), got shape {x.shape}")
    kk = min(cfg.max_partners, len(x) - 1)
    _, nn = knn(x, x, kk + 1)  # (N, K + 1), itself first (or a tie)
    partners = np.array([row[row != i][:kk] for i, row in enumerate(nn)], np.int32)  # (N, K)
    return Model(x.copy(), partners, float(kk), 0.0, cfg.t_max)


def sample(model: Model, n: int, seed: int, chunk: int = BLOCK, side: int = 0) -> Iterator[np.ndarray]:
    """n draws as chunks of ``chunk`` (the last one shorter) (chunk, D) float32 unit rows; row i is the same
    for any chunk and any n > i. At most one block and one chunk are held."""
    for lo in range(0, n, chunk):
        yield rows(model, seed, np.arange(lo, min(n, lo + chunk)), side)


def rows(model: Model, seed: int, ids: np.ndarray, side: int = 0) -> np.ndarray:
    """Draws number ``ids`` (any order, repeats allowed) of the stream (seed, side). (len(ids), D)"""
    ids = np.asarray(ids, np.int64)
    out = np.empty((len(ids), model.centres.shape[1]), np.float32)
    for b in np.unique(ids // BLOCK):
        where = np.flatnonzero(ids // BLOCK == b)
        u = np.random.default_rng([seed, STREAM + side, int(b)]).random((BLOCK, 3))[ids[where] - b * BLOCK]  # (m, 3)
        centre = np.minimum((u[:, 0] * len(model.centres)).astype(np.int64), len(model.centres) - 1)
        rank = np.minimum((u[:, 1] * model.k).astype(np.int64), model.partners.shape[1] - 1)
        t = (model.t_min + u[:, 2] * (model.t_max - model.t_min)).astype(np.float32)[:, None]  # (m, 1)
        x = model.centres[centre]
        out[where] = normalize(x + t * (model.centres[model.partners[centre, rank]] - x))
    return out


def draws(model: Model, n: int, seed: int) -> np.ndarray:
    """n draws in memory (calibration and validation sizes only). (n, D)"""
    return rows(model, seed, np.arange(n))


def knn(queries: np.ndarray, base: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact inner-product top k: (Q, k) scores and ids."""
    return faiss.knn(np.ascontiguousarray(queries, np.float32), np.ascontiguousarray(base, np.float32), k,
                     metric=faiss.METRIC_INNER_PRODUCT)


def near_rate(a: np.ndarray, b: np.ndarray, near: float) -> float:
    """Share of a's rows with a row of b at cosine above ``near``."""
    return float((knn(a, b, 1)[0][:, 0] > near).mean())


def recall(gallery: np.ndarray, queries: np.ndarray, positives: list[set[int]], k: int = 10) -> float:
    """Share of queries with a positive (a gallery row) among their k best rows, exact inner product."""
    ids = knn(queries, gallery, k)[1]
    return float(np.mean([bool(p & set(row.tolist())) for p, row in zip(positives, ids)]))


def calibrate(model: Model, held_out: np.ndarray, queries: np.ndarray, positives: list[set[int]],
              cfg: DensityConfig = DensityConfig()) -> Model:
    """Set t_min and k on held-out vectors (not fitted), their queries and positives (rows of held_out).

    For each k of the grid: t_min by bisection so the near-copy rate of len(centres) draws matches the
    held-out one; then recall@k of the queries with held_out hidden among len(centres) draws (mean over
    cfg.seeds). k is interpolated (log scale) where that recall crosses the real one, held_out hidden among
    the fitted vectors; t_min is set again at that k.
    """
    fitted = model.centres
    near_real = near_rate(held_out, fitted, cfg.near)
    real = recall(np.concatenate([held_out, fitted]), queries, positives, cfg.k_recall)
    found = []
    for k in [k for k in cfg.partner_grid if k <= model.partners.shape[1]]:
        model.k = float(k)
        _fit_t_min(model, near_real, cfg)
        got = [recall(np.concatenate([held_out, draws(model, len(fitted), s)]), queries, positives, cfg.k_recall)
               for s in range(cfg.seeds)]
        found.append((k, model.t_min, float(np.mean(got)), float(np.std(got))))
    model.k = _crossing([f[0] for f in found], [f[2] for f in found], real)
    _fit_t_min(model, near_real, cfg)
    model.calibration = {"near": cfg.near, "near_rate_held_out": near_real,
                         "near_rate_draws": near_rate(draws(model, len(fitted), 0), fitted, cfg.near),
                         "recall_real": real, "grid": found, "k": model.k, "t_min": model.t_min,
                         "held_out": len(held_out), "queries": len(queries)}
    return model


def _fit_t_min(model: Model, target: float, cfg: DensityConfig) -> None:
    """Bisection on t_min in [0, t_max]: the draws' near-copy rate falls as t_min grows."""
    lo, hi = 0.0, model.t_max
    for _ in range(cfg.steps):
        model.t_min = (lo + hi) / 2
        rate = near_rate(draws(model, len(model.centres), 0), model.centres, cfg.near)
        lo, hi = (model.t_min, hi) if rate > target else (lo, model.t_min)
    model.t_min = (lo + hi) / 2


def _crossing(ks: list[int], recalls: list[float], real: float) -> float:
    """The k (log-linear between grid points) where recall (rising with k) meets the real recall."""
    for (k0, r0), (k1, r1) in zip(zip(ks, recalls), zip(ks[1:], recalls[1:])):
        if r0 <= real <= r1 and r1 > r0:
            return float(np.exp(np.log(k0) + (real - r0) / (r1 - r0) * (np.log(k1) - np.log(k0))))
    return float(ks[int(np.argmin([abs(r - real) for r in recalls]))])  # no crossing: the nearest


def save(model: Model, path) -> None:
    np.savez(path, centres=model.centres, partners=model.partners, k=model.k, t_min=model.t_min,
             t_max=model.t_max, calibration=np.array(json.dumps(model.calibration)))
