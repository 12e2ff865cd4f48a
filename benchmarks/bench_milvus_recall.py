"""An index in Milvus Lite, budget by budget: export seconds, and t2i recall@10 of Milvus against the local codes.

    python -m benchmarks.bench_milvus_recall INDEX SPLIT.jsonl WORK      # e.g. demo/index demo/data/test.jsonl

Queries: the split's distinct captions (their stored caption vectors, as ``benchmarks.index_codes`` takes
them); gallery: every image of the index, which is what a served collection answers. Per budget (none:
the float vectors at D, then each ``--bytes`` budget of the index) it prints the local code's recall (its
stored codes over all rows), the Milvus Lite collection's (the index ``triclip index export`` chose there,
IVF_SQ8 where Lite has no equivalent of the code), and the recall of FAISS's IVF-PQ with the sub-quantisers
and bits a Milvus server's IVF_PQ would get (Milvus builds IVF_PQ with FAISS's algorithm; trained on all
rows, nlist and nprobe as the export records them): an estimate for a server, not a server measured.
The first export (float, with captions) is the timed one: the whole index as ``triclip index export``
writes it by default.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import faiss
import numpy as np

from triclip.index import milvus as mv
from triclip.index.budgets import EvalSet, recall_at_k
from triclip.index.config import ExportConfig
from triclip.index.milvus_export import export
from triclip.index.store import load_contents
from triclip.index.vectors import exact_topk, prefix


def eval_set(index: str, split: str):
    """Queries: the split's distinct captions; gallery: all of the index's images. Returns (EvalSet, contents)."""
    contents = load_contents(index)
    folder = os.path.dirname(os.path.abspath(split))
    with open(split, encoding="utf-8") as fh:
        paths = {os.path.join(folder, json.loads(line)["image"]) for line in fh if line.strip()}
    rows = {i for i, row in enumerate(contents.meta) if row["image"] in paths}
    keep = [t for t, (r, _) in enumerate(contents.text_rows.tolist()) if r in rows]
    texts = [contents.meta[r]["captions"][c] for r, c in contents.text_rows[keep].tolist()]
    owner = contents.text_rows[keep, 0]
    ev = EvalSet.of(np.asarray(contents.vectors), np.asarray(contents.text_vectors[keep]), owner, texts, "split", split)
    return ev, contents


def milvus_recall(db: str, name: str, ev: EvalSet) -> float:
    client = mv.connect(db)
    try:
        client.load_collection(name)
        props = mv.read_properties(client, name)
        plan = json.loads(props["plan"])[0]
        queries = prefix(ev.queries, int(plan["m"]))
        found = []
        for s in range(0, len(queries), 256):
            answer = client.search(name, data=queries[s : s + 256].tolist(), limit=10, anns_field="vector",
                                   search_params={"metric_type": "IP", "params": plan["search"]}, output_fields=["row"])
            found += [[h["row"] for h in hits] + [-1] * (10 - len(hits)) for hits in answer]
        return recall_at_k(np.asarray(found), ev.positives)
    finally:
        mv.close(client)


def faiss_ivfpq(ev: EvalSet, m: int, sub: int, nbits: int, nlist: int, nprobe: int) -> float:
    """Recall of FAISS IVF-PQ (what a Milvus server's IVF_PQ builds) on the m-prefix, trained on the gallery."""
    base = prefix(ev.gallery, m)
    index = faiss.IndexIVFPQ(faiss.IndexFlatIP(m), m, nlist, sub, nbits, faiss.METRIC_INNER_PRODUCT)
    index.train(base)
    index.add(base)
    index.nprobe = nprobe
    return recall_at_k(index.search(prefix(ev.queries, m), 10)[1], ev.positives)


def main(index: str, split: str, work: str) -> None:
    ev, contents = eval_set(index, split)
    full = recall_at_k(exact_topk(ev.gallery, ev.queries, 10), ev.positives)
    print(f"{len(ev.gallery)} images, {len(ev.queries)} queries ({split}); t2i recall@10, float32 at D: {full:.3f}")
    Path(work).mkdir(parents=True, exist_ok=True)
    db = str(Path(work) / "bench.db")
    shutil.rmtree(db, ignore_errors=True)
    started = time.perf_counter()
    summary = export(ExportConfig(index=index, to=db, collection="float"))
    print(f"export, float at D with captions ({summary['count']} images, {summary['text_count']} captions):"
          f" {time.perf_counter() - started:.1f} s; Milvus Lite {summary['index_type']}: {milvus_recall(db, 'float', ev):.3f}")
    for budget, codec in sorted(contents.codes.items()):
        started = time.perf_counter()
        s = export(ExportConfig(index=index, to=db, collection=f"b{budget}", bytes=budget, text=False))
        seconds = time.perf_counter() - started
        local = recall_at_k(codec.search(ev.queries, 10)[1], ev.positives)
        lite = milvus_recall(db, f"b{budget}", ev)
        line = (f"{budget} B {codec.spec.label()}: local {local:.3f}; Milvus Lite {s['index_type']} m={s['m']}"
                f" ({s['m']} B/vector): {lite:.3f} (export {seconds:.1f} s)")
        if codec.spec.codec in ("pq", "opq", "rq"):
            p = codec.spec.params
            nlist, nprobe = s["params"].get("nlist") or 1, json.loads(_prop(db, f"b{budget}", "plan"))[0]["search"]["nprobe"]
            estimate = faiss_ivfpq(ev, codec.spec.m, int(p["M"]), int(p["nbits"]), nlist, nprobe)
            line += f"; server IVF_PQ {p['M']}x{p['nbits']} (FAISS IVF-PQ, nlist {nlist}, nprobe {nprobe}): {estimate:.3f}"
        print(line, flush=True)


def _prop(db: str, name: str, key: str) -> str:
    client = mv.connect(db)
    try:
        return mv.read_properties(client, name)[key]
    finally:
        mv.close(client)


if __name__ == "__main__":
    main(*sys.argv[1:4])
