"""Query-weighted vector codes: RQ / OPQ trained to minimise the error of the query-image SCORE, not of the vector.

Usage::

    .venv/bin/python -m benchmarks.bench_query_weighted --runs RUNS/oc/mrl_solved_tricl --data DATA/oc \\
        [--budgets 8,16] [--codecs rq,opq]

The question (docs/results_bytes.md, "Query-weighted vector codes"): the mixed code allocates bits by what a
dimension contributes to the score ``q . x`` (triclip/index/allocation.py); can a vector quantiser use the same
importance? A code's score error for a query is ``q . e`` (``e`` the image's coding error), whose mean square
over the queries is ``e^T C e`` with ``C = E[q q^T]``. Coding ``x' = A x`` with ``A^T A = C`` makes a quantiser's
own objective ``|A e|^2`` exactly that error, and the query is searched as ``A^-T q`` (``q . x = A^-T q . A x``).
``diag`` keeps only C's diagonal (``w_j = E[q_j^2]``, the mixed code's weights), ``full`` the whole matrix;
``eps`` adds ``eps * mean eigenvalue`` to C (regularises A^-1). C is measured on the train split's texts, the
codes are trained on its images, and everything is scored on test as ``bench_bytes`` does (t2i R@10 over
distinct texts). Runs and their ``served.npz`` come from ``bench_bytes measure``.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import faiss  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_bytes import K, mean_sd, recall, served, sides  # noqa: E402
from triclip.index.codecs import CodecSpec, lookup  # noqa: E402

WEIGHTINGS = (("none", 0.0), ("diag", 0.0), ("diag", 0.1), ("full", 0.01), ("full", 0.1))


def weighting(queries: np.ndarray, how: str, eps: float) -> np.ndarray:
    """``A`` with ``A^T A = C + eps * mean_eig(C) * I`` up to scale, ``C = E[q q^T]`` (``diag``: its diagonal).

    Shapes: (Q, D) -> (D, D) float32; ``none`` is the identity.
    """
    d = queries.shape[1]
    if how == "none":
        return np.eye(d, dtype=np.float32)
    cov = queries.T.astype(np.float64) @ queries / len(queries)  # (D, D)
    if how == "diag":
        w = np.diag(cov) + eps * np.trace(cov) / d
        return np.diag(np.sqrt(w / w.mean())).astype(np.float32)
    if how != "full":
        raise ValueError(f"weighting is none, diag or full, got {how!r}")
    lam, u = np.linalg.eigh(cov + eps * np.trace(cov) / d * np.eye(d))
    return (np.sqrt(lam / lam.mean())[:, None] * u.T).astype(np.float32)  # |A e|^2 = e^T (C + eps) e, scaled


def quantiser(codec: str, budget: int, d: int, n: int) -> faiss.Index:
    """The index's own RQ (LUT search, no norms) or OPQ+PQ at ``budget`` bytes on all d dimensions, as
    ``triclip.index.codecs`` builds it for n training vectors (without its top-m re-normalisation: A x is not unit)."""
    _, inner, rotation = lookup(codec).faiss_parts(CodecSpec(codec, d, budget, {"M": budget, "nbits": 8}), n)
    return inner if rotation is None else faiss.IndexPreTransform(rotation, inner)


def weighted_ids(codec: str, budget: int, a: np.ndarray, train, gallery, q) -> np.ndarray:
    """Top-K gallery ids of ``q`` against the code of ``A x`` trained on ``A train``, searched with ``A^-T q``."""
    index = quantiser(codec, budget, train.shape[1], len(train))
    index.train(np.ascontiguousarray(train @ a.T))
    index.add(np.ascontiguousarray(gallery @ a.T))
    return index.search(np.ascontiguousarray(q @ np.linalg.inv(a)), K)[1]


@dataclass
class WeightedConfig:
    runs: str  # RUNS/VARIANT with seedN/ runs (bench_bytes measure's)
    data: str  # the folder with train / val / test .jsonl the runs used
    budgets: list[int] = field(default_factory=lambda: [8, 16])  # bytes per vector
    codecs: list[str] = field(default_factory=lambda: ["rq", "opq"])  # codes trained on the weighted vectors


def main(argv=None) -> int:
    from triclip.app.options import parse_config

    ns = parse_config(WeightedConfig, argv, __doc__.split("\n")[0])
    rows: dict[tuple, list[tuple[float, float]]] = {}
    for run in sorted(Path(ns.runs).glob("seed*")):
        split = served(run, Path(ns.data))
        train, text = split["train"]["image"], split["train"]["text"]
        gallery, q, relevant = sides(split["test"], "t2i")
        full = recall(np.argsort(-(q @ gallery.T), axis=1)[:, :K], relevant)["r10"]
        print(f"{run}: full D {full:.3f}", flush=True)
        maps = {(how, eps): weighting(text, how, eps) for how, eps in WEIGHTINGS}  # one A per weighting and run
        for budget in ns.budgets:
            for codec in ns.codecs:
                for (how, eps), a in maps.items():
                    if codec == "opq" and how == "full":
                        continue  # OPQ learns its own rotation; only the diagonal scaling is new to it
                    r = recall(weighted_ids(codec, budget, a, train, gallery, q), relevant)["r10"]
                    rows.setdefault((budget, codec, how, eps), []).append((r, full))
                    print(f"  {budget:>3} B {codec:<4} {how:<4} eps={eps:<5} {r:.3f}", flush=True)
    print("\n| B | code | weighting | test t2i R@10 | share of full D | − unweighted (paired) |\n|---:|---|---|---:|---:|---:|")
    for (budget, codec, how, eps), got in rows.items():
        r, full = np.array(got).T
        base = np.array(rows[(budget, codec, "none", 0.0)])[:, 0]
        name = "none" if how == "none" else f"{how}, eps {eps:g}"
        print(f"| {budget} | {codec} | {name} | {mean_sd(list(r))} | {np.mean(r / full):.0%} | {mean_sd(list(r - base))} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
