"""How long ``index build --embeddings DIR --bytes B`` takes to choose its codes: the choice alone, per side.

Usage::

    .venv/bin/python -m benchmarks.bench_choice H2M/embeddings --bytes 16 [--side image|text|both]

Opens the shards as ``index build --embeddings`` does (``triclip.index.sources.open_embeddings``), measures the
codes on the same evaluation set (the indexed data's first images, ``triclip.index.budgets.indexed_evaluation``)
with the default rules (the latency bound: the float32 scan at N; re-ranking offered), and prints per side the
CPU seconds (user + sys, this process) and wall seconds of ``triclip.index.budgets.choose_all``, then every
candidate: recall@10, latency at N (measured or extrapolated) or why it was left out. Nothing is written.
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time

from triclip.index import budgets as bud
from triclip.index import report
from triclip.index.config import IndexBuildConfig
from triclip.index.sources import open_embeddings


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and its threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def choose_side(vectors, evaluation, budgets: list[int]) -> tuple[list, float, float]:
    """The choices of one side and the CPU and wall seconds they took."""
    cpu, wall = cpu_seconds(), time.perf_counter()
    choices = bud.choose_all(budgets, vectors, evaluation, rules=bud.Rules(n=vectors.count))
    return choices, cpu_seconds() - cpu, time.perf_counter() - wall


def lines(side: str, n: int, choices: list, cpu: float, wall: float) -> list[str]:
    """The printed block of one side."""
    out = [f"{side}: N = {n:,}, the choice took {cpu:.1f} CPU s ({wall:.1f} s wall)"]
    for c in choices:
        out.append(f"  {c.budget} B kept: {bud._words(c.kept)}, recall@10 {c.recall:.4f}, {c.kept.latency.ms:.3g} ms"
                   f" ({c.kept.latency.how}); bound {c.bound_ms:.3g} ms (float32 scan) {c.note}")
        out += ["    - " + report._candidate(t) + (f", keeps {t['keeps']}" if t.get("keeps", 1) != 1 else "")
                for t in c.tried]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("embeddings", help="a folder of embedding shards (triclip embed, benchmarks.haystack build)")
    p.add_argument("--bytes", default="16", help="budgets, e.g. 8,16")
    p.add_argument("--side", choices=("image", "text", "both"), default="both")
    ns = p.parse_args(argv)
    budgets = bud.parse_budgets([int(b) for b in ns.bytes.split(",")])
    with tempfile.TemporaryDirectory() as out:
        coll = open_embeddings(IndexBuildConfig(embeddings=ns.embeddings, out=out))
    evaluation = bud.indexed_evaluation(coll.image, coll.text, coll.text_rows, coll.meta, bud.EVAL_MAX_IMAGES,
                                        ns.embeddings)
    sides = {"image": (coll.image, evaluation), "text": (coll.text, evaluation.reverse())}
    for side in ("image", "text") if ns.side == "both" else (ns.side,):
        vectors, ev = sides[side]
        print("\n".join(lines(side, vectors.count, *choose_side(vectors, ev, budgets))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
