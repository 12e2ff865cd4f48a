"""The build's cold timing of a re-rank from disk against the benchmark's, on one index, in one process.

    PYTHONPATH=. python scripts/cold_drift.py INDEX QUERIES.npy BYTES [--rounds 3] [--queries 75] [--fresh-copy]

Each round times the same queries, one after the other:

- ``build``: ``LatencyModel.cold_search`` on the budget's codes and the live version's vectors file, as
  ``index build`` times a kept variant at N (``triclip.index.scale.cold_ms``);
- ``bench ids``: ``scripts/peer_worker.py``'s ``cold_query_ms`` over the Searcher's row ids (every file under INDEX
  evicted before each query), as ``benchmarks.haystack_peers`` reports "p50 ms cold, ids only";
- ``bench full``: the same with the hits' meta rows read ("p50 ms cold");
- ``version only`` / ``vectors only``: the benchmark's way, evicting only the live version's files / its vectors.

``--fresh-copy`` adds ``build`` on a copy of the vectors file (``.cold_drift-vectors.npy`` beside INDEX, removed at
the end) written just before the first round (does a file
just written read faster cold?). Prints one JSON line per round: median milliseconds of each. Torch-free.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import peer_worker  # noqa: E402

from triclip.codecs.threads import set_search_threads  # noqa: E402
from triclip.index.diskrows import evict  # noqa: E402
from triclip.index.latency import LatencyModel  # noqa: E402
from triclip.index.store import load_contents  # noqa: E402


def median_evicted(search, queries: np.ndarray, files: list[str]) -> float:
    """Median ms of ``peer_worker.evicted_query_ms``: each query searched once untimed, ``files`` evicted, timed."""
    return float(np.median(peer_worker.evicted_query_ms(search, queries, files)))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("index")
    p.add_argument("queries", help=".npy (Q, D) float query vectors (e.g. a haystack's val_queries.npy)")
    p.add_argument("bytes", type=int, help="the budget whose stored stages are timed")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--queries", dest="count", type=int, default=75, help="queries per timing (the build's: 75)")
    p.add_argument("--fresh-copy", action="store_true")
    args = p.parse_args(argv)
    contents = load_contents(args.index, indexes="codes")
    codes, stage = contents.codes[args.bytes], contents.manifest["budgets"][str(args.bytes)]
    shortlist, vectors = stage["rescore"]["shortlist"], str(contents.vectors.filename)
    search = peer_worker.triclip_load({"dir": args.index, "bytes": args.bytes})
    queries = np.ascontiguousarray(np.load(args.queries), np.float32)[: args.count]
    version = os.path.dirname(vectors)
    files = {"bench ids": peer_worker.index_files(args.index), "version only": peer_worker.index_files(version),
             "vectors only": [vectors]}
    copy = os.path.join(os.path.dirname(args.index.rstrip("/")) or ".", ".cold_drift-vectors.npy")
    if args.fresh_copy:
        shutil.copyfile(vectors, copy)
        evict(copy)
    print(json.dumps({"code": codes.spec.label(), "shortlist": shortlist, "build recorded": stage.get("latency")}))
    try:
        for r in range(args.rounds):
            set_search_threads(1)
            row = {"round": r, "build": LatencyModel().cold_search(codes, vectors, queries, shortlist)}
            if args.fresh_copy:
                row["build, fresh copy"] = LatencyModel().cold_search(codes, copy, queries, shortlist)
            row["bench ids"] = median_evicted(search.rows, queries, files["bench ids"])
            row["bench full"] = median_evicted(search, queries, files["bench ids"])
            for name in ("version only", "vectors only"):
                row[name] = median_evicted(search.rows, queries, files[name])
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    finally:
        if args.fresh_copy and os.path.exists(copy):
            os.remove(copy)


if __name__ == "__main__":
    main()
