"""Where inverted lists pay: one query, one thread, a flat scan of a code against the same code in lists, by N.

Usage::

    .venv/bin/python -m benchmarks.bench_ivf --sizes 10000,30000,100000,300000 --code pqfs --budget 16

Synthetic unit vectors (``benchmarks.bench_index.synthetic``: D = 256, a power-law spectrum, clustered). Per N:
the code (``--code``, its first candidate of ``--budget`` bytes) fitted on 20,000 vectors and filled with N, flat
and in ``triclip.codecs.ivf.lists_for(N)`` lists (at most 20,000 / 39 of them: the training sample), its
nprobe tuned as ``index build`` does (``triclip.index.budgets.tune_nprobe``: the smallest power of two keeping
``--target`` of its own exhaustive top 10, on 200 queries); the median single-query latency of each
(``triclip.index.latency``, one thread, in the same run), the flat float32 scan at D beside them, and recall@10 of
the lists at that nprobe against their own exhaustive scan (on 200 other queries), and of each code against exact
float32 search. ``triclip.codecs.ivf.IVF_MIN_N`` is set from this.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import faiss  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_index import synthetic  # noqa: E402
from triclip import codecs  # noqa: E402
from triclip.index.budgets import overlap, tune_nprobe  # noqa: E402
from triclip.codecs.ivf import lists_for  # noqa: E402
from triclip.index.latency import _median_ms  # noqa: E402

D = 256
TRAIN = 20_000


def measure(n: int, code: str, budget: int, target: float, centres: np.ndarray, q: np.ndarray) -> dict:
    """One N: latencies of the flat code, the code in lists, the float32 scan; the lists' recall."""
    flat_spec = next(s for s in codecs.candidates(budget, D) if s.codec == code)
    train = synthetic(TRAIN, D, 1, centres)
    x = synthetic(n, D, 2, centres)
    flat = codecs.fit(flat_spec, train)
    flat.add(x)
    params = {"inner": code, **flat_spec.params, "nlist": lists_for(n), "nprobe": 1}
    lists = codecs.fit(codecs.CodecSpec("ivf", flat_spec.m, flat_spec.bytes_per_vector, params), train)
    lists.add(x)
    nprobe, kept = tune_nprobe(lists, q[:200], target)
    floats = faiss.IndexFlatIP(D)
    floats.add(x)
    truth = floats.search(q[200:], 10)[1]  # exact float32 top 10
    return {
        "n": n, "code": flat_spec.label(), "nlist": int(lists.ivf.nlist), "nprobe": nprobe,
        "flat_ms": round(_median_ms(lambda v: flat.search(v, 10), q[200:]), 4),
        "ivf_ms": round(_median_ms(lambda v: lists.search(v, 10, params={"nprobe": nprobe}), q[200:]), 4),
        "float32_ms": round(_median_ms(lambda v: floats.search(v, 10), q[200:]), 4),
        "ivf_keeps": round(overlap(lists.search(q[200:], 10, params={"nprobe": nprobe})[1],
                                   lists.search(q[200:], 10, params=lists.exhaustive())[1]), 3),
        "tuned_keeps": round(kept, 3),
        "flat_recall": round(overlap(flat.search(q[200:], 10)[1], truth), 3),
        "ivf_recall": round(overlap(lists.search(q[200:], 10, params={"nprobe": nprobe})[1], truth), 3),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--sizes", default="10000,30000,100000,300000")
    p.add_argument("--code", default="pqfs", help="the flat code put in lists (an ivf inner code)")
    p.add_argument("--budget", type=int, default=16)
    p.add_argument("--target", type=float, default=0.95)
    p.add_argument("--json", action="store_true")
    ns = p.parse_args(argv)
    rng = np.random.default_rng(0)
    centres = rng.standard_normal((1000, D)).astype(np.float32)
    q = synthetic(400, D, 3, centres)
    rows = []
    for n in (int(s) for s in ns.sizes.split(",")):
        rows.append(measure(n, ns.code, ns.budget, ns.target, centres, q))
        r = rows[-1]
        if not ns.json:
            print(f"N={r['n']:>9,} {r['code']:<18} flat {r['flat_ms']:>8.3f} ms (recall {r['flat_recall']:.3f}) |"
                  f" ivf{r['nlist']}/{r['nprobe']} {r['ivf_ms']:>8.3f} ms (recall {r['ivf_recall']:.3f}, keeps"
                  f" {r['ivf_keeps']:.3f} of its exhaustive top 10) | float32 {r['float32_ms']:>8.3f} ms", flush=True)
    if ns.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
