"""``triclip demo``: the whole pipeline on the built-in ``shapes`` data, on the CPU in minutes.

1. prepare 3,000 ``shapes`` records (``WORKDIR/data``),
2. train the ``tiny`` preset with the tri-factor objective (``WORKDIR/run``),
3. evaluate it, with the compact curve (importance order against the baselines),
4. index the validation images at the top D/4 dimensions and answer two queries.

Each step is skipped when its output is already there, so a second run is quick.
"""

from __future__ import annotations

import json
from pathlib import Path

from retrieval.data.builtin import prepare
from retrieval.run import METRICS, load_run
from training.evaluate import evaluate_run
from training.train import TrainConfig, train

DEMO_QUERIES = ("a red circle", "two small blue squares")


def run_demo(workdir: str = "demo", num: int = 3000, epochs: int = 6) -> dict:
    work = Path(workdir)
    data, run = work / "data", work / "run"
    if not (data / "val.jsonl").exists():
        print(f"[1/4] preparing {num} shapes records in {data}")
        prepare("shapes", str(data), num=num, seed=0)
    else:
        print(f"[1/4] data already in {data}")
    if not _finished(run, epochs):
        print(f"[2/4] training tiny + tricl for {epochs} epochs in {run}")
        cfg = TrainConfig(
            train_data=str(data / "train.jsonl"),
            val_data=str(data / "val.jsonl"),
            out=str(run),
            model="tiny",
            loss="tricl",
            epochs=epochs,
            batch_size=64,
            resume=(run / "config.json").exists(),
        )
        train(cfg)
    else:
        print(f"[2/4] run already trained in {run}")
    print("[3/4] evaluating (t2i recall@10 of the compact embeddings per ordering)")
    result = evaluate_run(str(run), str(data / "val.jsonl"), dims=[4, 8, 16, 32])
    print(_table(result))
    result["search"] = _index_and_search(run, data, work / "index")
    return result


def _finished(run: Path, epochs: int) -> bool:
    path = run / METRICS
    return path.exists() and len(path.read_text().splitlines()) >= epochs


def _table(result: dict) -> str:
    lines = [
        f"full dimension: t2i R@1 {result['t2i_r1']:.3f}  R@10 {result['t2i_r10']:.3f}   "
        f"i2t R@1 {result['i2t_r1']:.3f}  R@10 {result['i2t_r10']:.3f}   "
        f"align {result['align']:.3f}  uniform {result['uniform']:.3f}"
    ]
    curve = result["compact"]
    dims = sorted({int(m) for per in curve.values() for m in per})
    lines.append("ordering     " + "".join(f"m={m:<7d}" for m in dims))
    for ordering, per in curve.items():
        values = {int(m): v for m, v in per.items()}
        lines.append(f"{ordering:<12} " + "".join(f"{values[m]:<9.3f}" for m in dims))
    return "\n".join(lines)


def _index_and_search(run: Path, data: Path, out: Path) -> dict:
    from index.build import IndexBuildConfig, build_index
    from index.search import Searcher

    model, _ = load_run(run)
    m = max(1, model.embed_dim // 4)
    if not (out / "manifest.json").exists():
        print(f"[4/4] indexing the validation images at m={m} of D={model.embed_dim} in {out}")
        build_index(IndexBuildConfig(run=str(run), data=str(data / "val.jsonl"), out=str(out), dims=m, factory="Flat"))
    searcher = Searcher.load(str(out))
    hits = {}
    for query, found in zip(DEMO_QUERIES, searcher.search_text(list(DEMO_QUERIES), k=3)):
        hits[query] = found
        print(f"  {query!r}:")
        for hit in found:
            print(f"    {hit['score']:.3f}  {hit['caption']}  ({hit['image']})")
    print(f"next: triclip search --index {out} --text 'three large green triangles' --json")
    return json.loads(json.dumps(hits, default=str))
