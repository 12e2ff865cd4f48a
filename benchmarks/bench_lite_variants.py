"""Embedding speed of the ``lite``, ``lite1`` and ``lite2`` image towers on the CPU, side by side.

Usage::

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.bench_lite_variants --images 128 --rounds 3

For each preset, ``triclip.model.embed.embed_records`` over the first ``--images`` records of
``--data`` (decode, eval transform at the preset's resolution, the fast tower path of
``triclip.model.accel``, head), DataLoader workers 0. The presets alternate within each round,
so a load change on a shared machine hits them all alike; a preset's speed is its best
round and its ratio is to ``lite``'s best round of the same run. ``tower img/s`` times the
tower's fast path alone on the same images, already transformed.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

PRESETS = ("lite", "lite1", "lite2")  # compared in this order; the first is the ratio's base
DEFAULT_DATA = "data/openclipart/train.jsonl"


def summarize(seconds: dict[str, list[float]], items: int) -> list[dict]:
    """Best round per preset as items/s, and its ratio to the first preset's best.

    Args:
        seconds: preset -> wall seconds of each round.
        items: images per round.
    """
    best = {name: min(times) for name, times in seconds.items()}
    base = best[next(iter(best))]
    return [{"preset": name, "per_s": items / t, "ratio_to_first": base / t} for name, t in best.items()]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=DEFAULT_DATA, help="a prepared data set (jsonl)")
    parser.add_argument("--images", type=int, default=128, help="records embedded per round")
    parser.add_argument("--batch", type=int, default=64, help="images per forward")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (best counts)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    if not os.path.exists(args.data):
        raise SystemExit(f"{args.data} not found: triclip data prepare openclipart --out data/openclipart")
    from triclip.model import accel
    from triclip.data import PairDataset, PairSet, load_pairs
    from triclip.model.embed import embed_records
    from triclip.model.model import ModelConfig, build_model

    torch.set_grad_enabled(False)
    pairs = load_pairs(args.data)
    subset = PairSet(pairs.records[: args.images], source=pairs.source, max_pixels=pairs.max_pixels)
    models = {p: build_model(ModelConfig(preset=p)).eval() for p in PRESETS}
    batches = {}
    for name, model in models.items():
        dataset = PairDataset(subset, model.image_transform(train=False), train=False)
        batches[name] = torch.stack([dataset[i]["image"] for i in range(len(dataset))])  # (N, 3, S, S)
        embed_records(model, PairSet(subset.records[:2], source=pairs.source), "cpu", args.batch, 0)  # prepare
    print(f"threads {torch.get_num_threads()}, load average {os.getloadavg()}", flush=True)
    embed_s = {p: [] for p in PRESETS}
    tower_s = {p: [] for p in PRESETS}
    for _ in range(args.rounds):
        for name, model in models.items():
            start = time.perf_counter()
            emb, _, _ = embed_records(model, subset, "cpu", args.batch, 0)
            embed_s[name].append(time.perf_counter() - start)
            run = accel.inference_module(model.image_tower)
            start = time.perf_counter()
            for s in range(0, len(batches[name]), args.batch):
                run(batches[name][s : s + args.batch])
            tower_s[name].append(time.perf_counter() - start)
    result = {
        "images": len(subset.records),
        "backend": {p: accel.active_backend(m.image_tower) for p, m in models.items()},
        "embed": summarize(embed_s, len(subset.records)),
        "tower": summarize(tower_s, len(subset.records)),
        "load_after": os.getloadavg(),
    }
    print(f"{'preset':<7} {'size':>5} {'embed img/s':>12} {'x lite':>7} {'tower img/s':>12} {'x lite':>7}")
    for e, t in zip(result["embed"], result["tower"]):
        size = models[e["preset"]].image_tower.image_size
        print(f"{e['preset']:<7} {size:>5} {e['per_s']:12.1f} {e['ratio_to_first']:7.2f} {t['per_s']:12.1f} {t['ratio_to_first']:7.2f}")
    print(f"backends {result['backend']}, load average after {result['load_after']}")
    if args.json:
        from triclip.core.io import write_json_atomic

        write_json_atomic(args.json, result)
    return result


if __name__ == "__main__":
    main()
