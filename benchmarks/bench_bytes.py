"""Recall against bytes per vector: every code of ``triclip.codecs`` and the peers, on a run's served embeddings.

Usage::

    .venv/bin/python -m benchmarks.bench_bytes measure --data DIR --runs OUT --seeds 0,1,2 --steps N \\
        [--batch-size B] [--variant mrl_solved_tricl] [--budgets 8,16,32,64,128] [--direction t2i|i2t] --json FILE
    .venv/bin/python -m benchmarks.bench_bytes plot FILE [FILE ...] --png docs/results_bytes.png

``measure`` trains (or reuses) one run per seed with ``benchmarks.results``' recipes (``OUT/VARIANT/seedN``), embeds
DIR's train / val / test splits with it, and serves them as the index does (``sqrt(w) * z`` in importance order,
L2-normalised, signs anchored on the train images; cached in ``RUN/served.npz``). Every code is fitted on the
train split's image vectors and measured on the test split: its gallery is the test images, its queries the test
split's distinct texts (docs/CONTRACT.md, "Metrics"), scored as the code scores them (``Codec.search``); t2i R@1 / R@10.
``--direction i2t`` measures the caption codes instead (what ``index build --bytes`` stores for image -> text): every
code fitted on the train split's caption vectors, the gallery the test split's distinct texts, the queries its
images; i2t R@1 / R@10.

Rows (bytes = what a vector costs in memory):

- ``float32 top-m (today)``: the first m coordinates re-normalised, exact (today's pruned index);
- ``int8`` / ``binary`` / ``PQ`` / ``OPQ+PQ`` / ``RQ`` / ``mixed`` / ``float32 (codec)``: every codec of
  ``triclip.codecs``, its row named by the registry (``codecs.family``; MRL-style prefixes for int8 / binary:
  for an MRL run, MRL's prefix as int8 / binary); each family's m picked on the val split;
- ``triclip (chosen on val)``: of every ``codecs.candidates(B, D)``, the one best on val (what
  ``index build --bytes`` keeps), scored on test;
- ``PCA+PQ``: the vectors rotated onto their principal axes (numpy ``eigh``; FAISS's ``PCA{D},PQ{B}`` took
  3.5 min per fit here), then FAISS PQ with B sub-quantisers on all D (budgets with >= 4 dims per sub-quantiser);
- ``ST binary+rescore``: sentence-transformers' ``quantize_embeddings(..., "ubinary")`` of the first 8B
  coordinates and ``semantic_search_faiss(..., rescore=True, rescore_multiplier=4)`` (the package's float-query
  re-scoring of the shortlist against the bits; nothing more is stored);
- ``ST int8+rescore``: the same with ``"uint8"`` codes of the first B coordinates, ranges from the train split;
- ``ST binary->int8`` (re-scoring, in memory B bytes): the package's binary search of the first 8B coordinates
  for 40 candidates, re-scored with the float query against ``quantize_embeddings(..., "int8")`` codes of the
  full vectors (read from disk: D more bytes on disk), as sentence-transformers' quantized-retrieval demo does;
- ``triclip rescore`` (in memory B bytes): the val-chosen code's top 40, re-ranked with the float32 vectors
  (4D bytes on disk).

``plot`` draws test t2i R@10 against bytes (mean ± sd over seeds) for each JSON written by ``measure``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle FAISS threads sleep (see benchmarks/bench_index.py)

import faiss  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from triclip import codecs  # noqa: E402
from triclip.codecs.allocation import query_weights  # noqa: E402
from triclip.index.sources import prefix  # noqa: E402

K = 10
SHORTLIST = 40  # re-scoring candidates: 4 x k, sentence-transformers' rescore_multiplier 4
SPLITS = ("train", "val", "test")


# ---------------------------------------------------------------------------- served embeddings


def served(run: Path, data: Path) -> dict:
    """``{split: {"image", "text", "owner", "texts"}}`` as the index serves them (cached in ``run/served.npz``)."""
    cached = run / "served.npz"
    if not cached.exists():
        _embed_splits(run, data, cached)
    with np.load(cached) as z:
        return {
            s: {"image": z[f"{s}_image"], "text": z[f"{s}_text"], "owner": z[f"{s}_owner"],
                "texts": json.loads(str(z[f"{s}_texts"]))}
            for s in SPLITS
        }  # fmt: skip


def _embed_splits(run: Path, data: Path, out: Path) -> None:
    import torch

    from triclip.model.cache import locked_tower_outputs
    from triclip.compact.features import make_transform
    from triclip.data import load_pairs
    from triclip.model.embed import embed_pairs
    from triclip.core.io import atomic_path
    from triclip.model.run import load_run

    model, _ = load_run(run, "cpu")
    arrays, transform = {}, None
    with torch.no_grad():
        for split in SPLITS:
            pairs = load_pairs(str(data / f"{split}.jsonl"))
            image, text, owner, keep, _ = embed_pairs(model, pairs, "cpu", 256, locked_tower_outputs(model, pairs, "cpu"))
            if transform is None:  # the index's transform at m = D, signs anchored on the train images
                w = model.importance().detach().float().cpu()
                transform = make_transform("importance", image.shape[1], image.shape[1], w).with_signs_from(image)
            texts = [c for i in keep.tolist() for c in pairs.records[i].captions]
            arrays.update({f"{split}_image": transform(image).numpy(), f"{split}_text": transform(text).numpy(),
                           f"{split}_owner": owner.numpy(), f"{split}_texts": np.array(json.dumps(texts))})  # fmt: skip
    with atomic_path(out) as tmp, open(tmp, "wb") as f:
        np.savez(f, **arrays)


# ---------------------------------------------------------------------------- queries and recall


def sides(split: dict, direction: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(gallery, queries, relevant) of a split: t2i searches the images with the distinct texts, i2t the distinct
    texts with the images (those carrying a text). Shapes: (N, D), (U, D), (U, N) bool."""
    q, relevant = queries(split)
    if direction == "t2i":
        return split["image"], q, relevant
    keep = relevant.any(0)  # images with a caption
    return q, split["image"][keep], np.ascontiguousarray(relevant.T[keep])


def queries(split: dict) -> tuple[np.ndarray, np.ndarray]:
    """Distinct texts as queries and which gallery images each finds relevant. Shapes: (U, D), (U, N) bool."""
    from triclip.compact.metrics import distinct_texts

    text_id, first_row = distinct_texts(split["texts"])
    relevant = np.zeros((len(first_row), len(split["image"])), bool)
    relevant[text_id.numpy(), split["owner"]] = True
    return split["text"][first_row.numpy()], relevant


def recall(ids: np.ndarray, relevant: np.ndarray) -> dict[str, float]:
    """t2i R@1 and R@10 from each query's ranked ids. Shapes: (U, >=10), (U, N)."""
    hit = np.take_along_axis(relevant, np.where(ids < 0, 0, ids), axis=1) & (ids >= 0)  # (U, k)
    return {"r1": float(hit[:, :1].any(1).mean()), "r10": float(hit[:, :K].any(1).mean())}


def check_against_metrics(split: dict, direction: str = "t2i") -> None:
    """Exact float32 recall here equals ``triclip.compact.metrics.retrieval_recall`` (over distinct texts)."""
    import torch

    from triclip.compact.metrics import retrieval_recall

    gallery, q, relevant = sides(split, direction)
    ids = np.argsort(-(q @ gallery.T), axis=1, kind="stable")[:, :K]
    ours = recall(ids, relevant)["r10"]
    theirs = retrieval_recall(torch.from_numpy(split["image"]), torch.from_numpy(split["text"]),
                              torch.from_numpy(split["owner"]), texts=split["texts"])[f"{direction}_r10"]  # fmt: skip
    if abs(ours - theirs) > 0.01:  # ties count against the query there, not here
        raise SystemExit(f"recall check failed: {ours:.4f} here vs {theirs:.4f} in triclip.compact.metrics")


# ---------------------------------------------------------------------------- methods


def codec_ids(codec: codecs.Codec, gallery: np.ndarray, q: np.ndarray, k: int = K) -> np.ndarray:
    """Top-k ids of a fresh copy of ``codec`` filled with ``gallery``."""
    fresh = codec.empty_copy()
    fresh.add(gallery)
    return fresh.search(q, k)[1]


def rescore(shortlist: np.ndarray, q: np.ndarray, stored: np.ndarray) -> np.ndarray:
    """Re-rank each query's candidates by ``q . stored[id]``. Shapes: (U, S), (U, D), (N, D) -> (U, K)."""
    scores = np.einsum("ud,usd->us", q, stored[np.where(shortlist < 0, 0, shortlist)].astype(np.float32))
    scores[shortlist < 0] = -np.inf
    return np.take_along_axis(shortlist, np.argsort(-scores, axis=1, kind="stable")[:, :K], axis=1)


def today(train, gallery, q, budget):
    m = min(gallery.shape[1], budget // 4)
    if m < 1:
        return None
    return np.argsort(-(q[:, :m] @ prefix(gallery, m).T), axis=1, kind="stable")[:, :K]


def pca_pq(train, gallery, q, budget):
    """PCA rotation (eigenvectors of the train vectors' second moment, largest first), then FAISS PQ on all D."""
    dim = gallery.shape[1]
    if dim < codecs.PQ_DIMS_PER_CODE * budget or dim % budget:
        return None
    _, vecs = np.linalg.eigh(train.T.astype(np.float64) @ train / len(train))  # ascending eigenvalues
    rot = np.ascontiguousarray(vecs[:, ::-1], dtype=np.float32)  # (D, D) orthonormal: inner products kept
    codec = codecs.fit(codecs.CodecSpec("pq", dim, budget, {"M": budget, "nbits": 8}), train @ rot)
    return codec_ids(codec, gallery @ rot, q @ rot)


def st_binary(train, gallery, q, budget, k=K, rescore=True):
    """sentence-transformers' binary search of the first 8B coordinates (its own float re-scoring when asked)."""
    from sentence_transformers.util.quantization import quantize_embeddings, semantic_search_faiss

    m = 8 * budget
    if m > gallery.shape[1]:
        return None
    corpus = quantize_embeddings(prefix(gallery, m), precision="ubinary")
    hits, _ = semantic_search_faiss(np.ascontiguousarray(q[:, :m]), corpus_embeddings=corpus, corpus_precision="ubinary",
                                    top_k=k, rescore=rescore, rescore_multiplier=SHORTLIST // K)  # fmt: skip
    return _hit_ids(hits, k)


def st_int8(train, gallery, q, budget):
    from sentence_transformers.util.quantization import quantize_embeddings, semantic_search_faiss

    m = min(budget, gallery.shape[1])
    calibration = prefix(train, m)
    corpus = quantize_embeddings(prefix(gallery, m), precision="uint8", calibration_embeddings=calibration)
    hits, _ = semantic_search_faiss(np.ascontiguousarray(q[:, :m]), corpus_embeddings=corpus, corpus_precision="uint8",
                                    calibration_embeddings=calibration, top_k=K, rescore=True,
                                    rescore_multiplier=SHORTLIST // K)  # fmt: skip
    return _hit_ids(hits, K)


def st_binary_int8(train, gallery, q, budget):
    """sentence-transformers' recipe: binary shortlist in memory, int8 re-scoring of the full vectors from disk."""
    from sentence_transformers.util.quantization import quantize_embeddings

    shortlist = st_binary(train, gallery, q, budget, SHORTLIST, rescore=False)
    if shortlist is None:
        return None
    int8 = quantize_embeddings(gallery, precision="int8", calibration_embeddings=train)  # on disk: D bytes
    return rescore(shortlist, q, int8)


def _hit_ids(hits: list[list[dict]], k: int) -> np.ndarray:
    return np.array([[h["corpus_id"] for h in row] + [-1] * (k - len(row)) for row in hits])


PEERS = {"float32 top-m (today)": today, "PCA+PQ": pca_pq, "ST binary+rescore": st_binary,
         "ST int8+rescore": st_int8, "ST binary->int8 (rescore)": st_binary_int8}  # fmt: skip


def measure_run(splits: dict, budgets: list[int], log=print, direction: str = "t2i") -> dict:
    """``{method: {budget: {"r1", "r10", "label"}}}`` on test for one run (codes fitted on train): the image codes
    (t2i), or the caption codes (i2t)."""
    coded, asking = ("image", "text") if direction == "t2i" else ("text", "image")
    train_img, train_q = splits["train"][coded], splits["train"][asking]  # the coded side, the query side
    val_g, val_q, val_rel = sides(splits["val"], direction)
    test_g, test_q, test_rel = sides(splits["test"], direction)
    check_against_metrics(splits["test"], direction)
    dim = train_img.shape[1]
    full = np.argsort(-(test_q @ test_g.T), axis=1, kind="stable")[:, :K]
    out: dict = {"float32 full D": {4 * dim: recall(full, test_rel)}}
    weights = query_weights(train_q)  # the mixed code's query weights: the train queries' second moment
    for budget in budgets:
        tried = []  # (val r10, test result, family, codec)
        for spec in codecs.candidates(budget, dim):
            codec = codecs.fit(spec, train_img, weights if spec.codec == "mixed" else None)
            val = recall(codec_ids(codec, val_g, val_q), val_rel)["r10"]
            test = {**recall(codec_ids(codec, test_g, test_q), test_rel), "label": codec.spec.label(), "val_r10": val}
            tried.append((val, test, codecs.family(spec.codec), codec))
            log(f"  {budget:>4} B  {codec.spec.label():<22} val {val:.3f}  test {test['r10']:.3f}")
        for family in dict.fromkeys(t[2] for t in tried):
            best = max((t for t in tried if t[2] == family), key=lambda t: t[0])
            out.setdefault(family, {})[budget] = best[1]
        chosen = max(tried, key=lambda t: t[0])
        out.setdefault("triclip (chosen on val)", {})[budget] = chosen[1]
        short = codec_ids(chosen[3], test_g, test_q, SHORTLIST)
        out.setdefault("triclip rescore (float32 on disk)", {})[budget] = {
            **recall(rescore(short, test_q, test_g), test_rel), "label": chosen[1]["label"] + " -> float32"}
        for name, method in PEERS.items():
            ids = method(train_img, test_g, test_q, budget)
            if ids is not None:
                out.setdefault(name, {})[budget] = recall(ids, test_rel)
                log(f"  {budget:>4} B  {name:<22} test {out[name][budget]['r10']:.3f}")
    return out


# ---------------------------------------------------------------------------- tables and plot


def mean_sd(values: list[float]) -> str:
    if len(values) < 2:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f}±{statistics.stdev(values):.3f}".replace("±0.", "±.")


def table(per_seed: list[dict], metric: str = "r10") -> str:
    """Methods as rows, budgets as columns, mean ± sd over seeds (full D float32 in its own column)."""
    budgets = sorted({int(b) for r in per_seed for name, row in r.items() if name != "float32 full D" for b in row})
    full = [next(iter(r["float32 full D"].values()))[metric] for r in per_seed]
    lines = ["| method | " + " | ".join(f"{b} B" for b in budgets) + " |", "|---|" + "---:|" * len(budgets)]
    names = {n for r in per_seed for n in r if n != "float32 full D"}
    for name in [n for n in SHOWN if n in names] + sorted(names - set(SHOWN)):
        cells = []
        for b in budgets:
            vals = [r[name][str(b)][metric] for r in per_seed if str(b) in r.get(name, {})]
            cells.append(mean_sd(vals) if len(vals) == len(per_seed) else "–")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    dim = int(next(iter(per_seed[0]["float32 full D"])))
    lines.append(f"\nfloat32 full D ({dim} B): {mean_sd(full)}")
    return "\n".join(lines)


PEER_ROWS = ["int8", "binary", "PQ", "OPQ+PQ", "RQ", "PCA+PQ", "ST binary+rescore", "ST int8+rescore"]  # in-memory peers


def paired(per_seed: list[dict], ours: str, budgets: list[int]) -> str:
    """Per budget: ``ours`` minus the best peer (the peer with the best mean), paired by seed, and the share of
    full-D recall ``ours`` keeps."""
    full = [next(iter(r["float32 full D"].values()))["r10"] for r in per_seed]
    lines = [f"| B | {ours} | best peer | {ours} − best peer (paired) | share of full D |", "|---:|---:|---|---:|---:|"]
    for b in budgets:
        key = str(b)
        peers = [p for p in PEER_ROWS if all(key in r.get(p, {}) for r in per_seed)]
        if key not in per_seed[0].get(ours, {}) or not peers:
            continue
        mine = [r[ours][key]["r10"] for r in per_seed]
        best = max(peers, key=lambda p: statistics.mean(r[p][key]["r10"] for r in per_seed))
        diffs = [a - r[best][key]["r10"] for a, r in zip(mine, per_seed)]
        share = statistics.mean(a / f for a, f in zip(mine, full))
        lines.append(f"| {b} | {mean_sd(mine)} | {best} | {mean_sd(diffs)} | {100 * share:.0f}% |")
    return "\n".join(lines)


SHOWN = ["float32 top-m (today)", "int8", "binary", "OPQ+PQ", "RQ", "PCA+PQ", "mixed", "triclip (chosen on val)",
         "ST binary+rescore", "ST int8+rescore", "ST binary->int8 (rescore)", "triclip rescore (float32 on disk)"]  # fmt: skip


def plot(files: list[str], png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.results import _save

    fig, axes = plt.subplots(1, len(files), figsize=(5.2 * len(files), 4.4), dpi=120, squeeze=False)
    for ax, path in zip(axes[0], files):
        saved = json.loads(Path(path).read_text())
        per_seed = saved["per_seed"]
        for n, name in enumerate(SHOWN):
            budgets = sorted(int(b) for b in per_seed[0].get(name, {}))
            vals = [[r[name][str(b)]["r10"] for r in per_seed] for b in budgets]
            if not budgets:
                continue
            sd = [statistics.stdev(v) if len(v) > 1 else 0 for v in vals]
            ls = "--" if name.startswith(("ST", "PCA")) else ":" if "rescore" in name else "-"
            ax.errorbar(budgets, [statistics.mean(v) for v in vals], yerr=sd, marker="o", ms=3, capsize=2, ls=ls,
                        label=name, color=plt.get_cmap("tab20")(2 * n % 20 + (n >= 10)))  # fmt: skip
        full = [next(iter(r["float32 full D"].values()))["r10"] for r in per_seed]
        ax.axhline(statistics.mean(full), color="k", lw=0.8, label=f"float32 full D ({saved['dim'] * 4} B)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(saved["budgets"], [str(b) for b in saved["budgets"]])
        ax.set_xlabel("bytes per vector in memory")
        ax.set_ylabel(f"test {saved.get('direction', 't2i')} recall@10 (distinct texts)")
        ax.set_title(f"{saved['name']}: {saved['variant']}, {len(per_seed)} seeds", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=6, loc="lower right")
    _save(fig, png)


# ---------------------------------------------------------------------------- command line


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("measure", allow_abbrev=False)
    p.add_argument("--data", required=True, help="folder with train / val / test .jsonl")
    p.add_argument("--runs", required=True, help="runs go to RUNS/VARIANT/seedN (reused when there)")
    p.add_argument("--name", default=None, help="data set name in the output (default: the folder's name)")
    p.add_argument("--variant", default="mrl_solved_tricl", help="a benchmarks.results variant (the demo's recipe)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=840)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--budgets", default="8,16,32,64,128")
    p.add_argument("--direction", choices=["t2i", "i2t"], default="t2i",
                   help="t2i: the image codes, text queries; i2t: the caption codes, image queries")
    p.add_argument("--json", required=True, help="write every number here")
    p = sub.add_parser("report", allow_abbrev=False, help="the tables of saved measurements")
    p.add_argument("files", nargs="+")
    p = sub.add_parser("plot", allow_abbrev=False)
    p.add_argument("files", nargs="+")
    p.add_argument("--png", required=True)
    ns = parser.parse_args(argv)
    if ns.cmd == "report":
        for path in ns.files:
            saved = json.loads(Path(path).read_text())
            runs = saved["per_seed"]
            what = saved.get("direction", "t2i")
            print(f"\n### {saved['name']} ({saved['variant']}, {len(runs)} seeds): test {what} R@10\n\n{table(runs)}\n")
            for ours in ("triclip (chosen on val)", "mixed", "triclip rescore (float32 on disk)"):
                print(paired(runs, ours, saved["budgets"]) + "\n")
        return 0
    if ns.cmd == "plot":
        plot(ns.files, ns.png)
        print(f"plot: {ns.png}")
        return 0
    from benchmarks.results import ResultsConfig, train_run
    from triclip.core.io import write_json_atomic

    cfg = ResultsConfig(data=ns.data, out=ns.runs, steps=ns.steps, batch_size=ns.batch_size)
    budgets = [int(b) for b in ns.budgets.split(",")]
    per_seed = []
    for seed in [int(s) for s in ns.seeds.split(",")]:
        run = train_run(cfg, ns.variant, seed)
        splits = served(run, Path(ns.data))
        print(f"{run}: train {len(splits['train']['image'])}, test {len(splits['test']['image'])} images", flush=True)
        measured = measure_run(splits, budgets, lambda s: print(s, flush=True), ns.direction)
        per_seed.append(json.loads(json.dumps(measured)))
        dim = splits["train"]["image"].shape[1]
        write_json_atomic(ns.json, {"name": ns.name or Path(ns.data).name, "variant": ns.variant, "dim": dim,
                                    "direction": ns.direction, "budgets": budgets, "per_seed": per_seed})  # fmt: skip
    print(f"\ntest {ns.direction} R@10, mean ± sd over {len(per_seed)} seeds:\n\n{table(per_seed)}")
    print(f"\ntest {ns.direction} R@1:\n\n{table(per_seed, 'r1')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
