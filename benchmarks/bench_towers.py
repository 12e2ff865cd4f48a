"""Inference speed of the ``lite`` towers on the CPU: eager fp32 against the fast paths.

Usage::

    .venv/bin/python -m benchmarks.bench_towers                       # openclipart if prepared, else noise
    .venv/bin/python -m benchmarks.bench_towers --rounds 5 --json out.json

Image tower (EfficientNet-Lite0), one batch of ``--batch`` images (real openclipart
thumbnails through the eval transform when ``--data`` exists, else Gaussian noise):

- ``eager``: the module as trained, NCHW, fp32.
- ``channels_last``: the same module and input in ``channels_last``.
- ``jit``: ``triclip.model.accel``'s fallback (trace, freeze, optimize_for_inference).
- ``onnxruntime``: ``triclip.model.accel``'s default where ``onnx`` + ``onnxruntime`` import.
- ``openvino``: for comparison only, where the ``openvino`` package imports.

Every method runs once per round, the methods alternating, so a load change on a
shared machine hits them all alike; a method's speed is its best round and its
ratio is to ``eager``'s best round of the same run. ``min cos`` is the lowest
cosine between a method's output rows and eager's. Text tower (all-MiniLM-L6-v2):
``--texts`` captions in batches of ``--text-batch``, in data order and sorted by
length (less padding), eager and ``onnxruntime``, and ``onnxruntime capped``: the batches of
``triclip.model.accel.text_batches`` (at most 2,048 padded tokens each; ``--longest`` takes the data's longest
captions, where the cap matters). Input pipeline: decode + eval
transform in one process (images/s, no model), and ``triclip.model.embed.embed_records``
end to end (decode, fast tower, head) over ``--pipeline-images`` images in batches of ``accel.IMAGE_BATCH``:
as many threads as the fast path takes, each decoding a batch and running a single-threaded tower (the
default), one background thread decoding ahead of a two-thread tower, and one DataLoader worker process,
alternating, best of ``--rounds``. The
header prints threads and the load average.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
import warnings
from typing import Callable

import torch
import torch.nn.functional as F

from triclip.model import accel
from triclip.model.towers import IMAGE_SIZE, ImageTower, TextTower

DEFAULT_DATA = "data/openclipart/train.jsonl"  # prepared by `triclip data prepare openclipart` (or the demo)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64, help="images per forward")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per method (best counts)")
    parser.add_argument("--texts", type=int, default=512, help="captions for the text tower")
    parser.add_argument("--text-batch", type=int, default=128, help="captions per forward")
    parser.add_argument("--data", default=DEFAULT_DATA, help="a prepared data set (jsonl) for real images and captions")
    parser.add_argument("--pipeline-images", type=int, default=1024, help="images of the embed_records lines")
    parser.add_argument("--skip-text", action="store_true", help="image tower only")
    parser.add_argument("--longest", action="store_true", help="the data's longest captions, not its first")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    print(f"threads {torch.get_num_threads()}, load average {_load()}, torch {torch.__version__}", flush=True)
    pairs = _pairs(args.data)
    result = {"threads": torch.get_num_threads(), "load_before": _load(), "batch": args.batch}
    result["images"] = bench_images(pairs, args.batch, args.rounds)
    if pairs is not None:
        result["decode_img_s"] = bench_decode(pairs, 4 * args.batch)
        print(f"decode + eval transform, one process: {result['decode_img_s']:.0f} img/s")
        result["pipeline_img_s"] = bench_pipelines(pairs, args.pipeline_images, accel.IMAGE_BATCH, args.rounds)
        for name, rate in result["pipeline_img_s"].items():
            print(f"embed_records (decode + fast tower + head), {name}: {rate:.1f} img/s")
    if not args.skip_text:
        result["texts"] = bench_texts(pairs, args.texts, args.text_batch, args.rounds, args.longest)
    result["load_after"] = _load()
    print(f"load average after: {result['load_after']}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=1)
    return result


# ---------------------------------------------------------------------------- image tower


def bench_images(pairs, batch: int, rounds: int) -> list[dict]:
    """Rows ``{"method", "img_s", "ratio", "min_cos", "prepare_s"}`` for every available method."""
    tower = ImageTower().eval()
    images = _image_batch(pairs, tower, batch)  # (B, 3, 224, 224)
    methods = image_methods(tower)
    reference = tower(images)  # (B, 1280) eager fp32
    rows = _race(methods, images, reference, rounds, batch)
    _print_table("image tower", "img/s", rows)
    return rows


def image_methods(tower: ImageTower) -> dict[str, tuple[Callable, float]]:
    """name -> (forward, seconds to prepare it)."""
    cl_tower = copy.deepcopy(tower).to(memory_format=torch.channels_last)  # ``tower`` stays NCHW
    methods = {
        "eager": (tower, 0.0),
        "channels_last": (lambda x: cl_tower(x.contiguous(memory_format=torch.channels_last)), 0.0),
    }
    for backend in ("jit", "onnxruntime"):
        if backend == "onnxruntime" and not accel.onnxruntime_available():
            print("onnxruntime: not installed (pip install onnx onnxruntime)")
            continue
        start = time.perf_counter()
        methods[backend] = (accel.inference_module(tower, backend), time.perf_counter() - start)
    openvino = _openvino_forward(tower)
    if openvino is not None:
        methods["openvino"] = openvino
    return methods


def _openvino_forward(tower) -> tuple[Callable, float] | None:
    """OpenVINO's CPU plugin on the converted tower (comparison only), or None when not installed."""
    try:
        import openvino as ov
    except ImportError:
        return None
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = ov.convert_model(tower, example_input=torch.zeros(1, 3, IMAGE_SIZE, IMAGE_SIZE), input=[(-1, 3, IMAGE_SIZE, IMAGE_SIZE)])
    compiled = ov.Core().compile_model(graph, "CPU", {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": "f32"})
    request = compiled.create_infer_request()
    run = lambda x: torch.from_numpy(request.infer({0: x.numpy()})[0].copy())  # noqa: E731
    return run, time.perf_counter() - start


def _image_batch(pairs, tower, batch: int) -> torch.Tensor:
    """(B, 3, 224, 224): real thumbnails through the eval transform, else noise."""
    if pairs is None:
        return torch.randn(batch, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(0))
    from triclip.data import PairDataset

    dataset = PairDataset(pairs, tower.image_transform(train=False), train=False)
    items = [dataset[i] for i in range(min(len(dataset), 4 * batch))]
    tensors = [item["image"] for item in items if item is not None][:batch]
    return torch.stack(tensors)


# ---------------------------------------------------------------------------- text tower


def bench_texts(pairs, count: int, batch: int, rounds: int, longest: bool = False) -> list[dict]:
    """Rows like ``bench_images``' for eager and onnxruntime: data order, sorted by length, and (onnxruntime)
    the batches of ``triclip.model.accel.text_batches`` (at most ``accel.MAX_TOKENS`` padded tokens each)."""
    tower = TextTower().eval()
    texts = _captions(pairs, count, longest)
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    plain = [list(range(s, min(s + batch, len(texts)))) for s in range(0, len(texts), batch)]
    by_length = [order[s : s + batch] for s in range(0, len(texts), batch)]

    def embed(forward, batches: list[list[int]]) -> Callable:
        def run(_):
            out = torch.zeros(len(texts), tower.output_dim)
            for chunk in batches:
                out[chunk] = forward(tower.tokenize([texts[i] for i in chunk]))
            return out

        return run

    methods = {"eager": (embed(tower, plain), 0.0), "eager sorted": (embed(tower, by_length), 0.0)}
    if accel.onnxruntime_available():
        start = time.perf_counter()
        fast = accel.inference_module(tower, "onnxruntime")
        prepare = time.perf_counter() - start
        methods["onnxruntime"] = (embed(fast, plain), prepare)
        methods["onnxruntime sorted"] = (embed(fast, by_length), prepare)
        capped = accel.text_batches(tower, texts, batch)
        methods["onnxruntime capped"] = (embed(fast, capped), prepare)
    reference = methods["eager"][0](None)  # (N, 384)
    rows = _race(methods, None, reference, rounds, len(texts))
    _print_table(f"text tower ({len(texts)} captions, batch {batch})", "texts/s", rows)
    return rows


def _captions(pairs, count: int, longest: bool = False) -> list[str]:
    """The first (or the longest) ``count`` captions of the data, else varied synthetic ones."""
    if pairs is not None:
        texts = [c for r in pairs.records for c in r.captions]
        texts = sorted(texts, key=len)[-count:] if longest else texts[:count]
        if texts:
            return texts
    words = "red blue small large cat dog house tree car boat flower star person music icon".split()
    return [" ".join(words[(i * 7 + k) % len(words)] for k in range(1 + i % 40)) for i in range(count)]


# ---------------------------------------------------------------------------- shared


def _race(methods: dict, inputs, reference: torch.Tensor, rounds: int, items: int) -> list[dict]:
    """Alternate the methods for ``rounds`` rounds after one warm-up call each; best round counts."""
    outputs, best = {}, {name: float("inf") for name in methods}
    for name, (forward, _) in methods.items():
        outputs[name] = forward(inputs)  # warm-up (oneDNN / ORT first-call work)
    for _ in range(rounds):
        for name, (forward, _) in methods.items():
            start = time.perf_counter()
            forward(inputs)
            best[name] = min(best[name], time.perf_counter() - start)
    base = best[next(iter(methods))]
    return [
        {
            "method": name,
            "per_s": items / best[name],
            "ratio": base / best[name],
            "min_cos": F.cosine_similarity(outputs[name].float(), reference, dim=1).min().item(),
            "prepare_s": prepare,
        }
        for name, (_, prepare) in methods.items()
    ]


def bench_decode(pairs, count: int) -> float:
    """Images/s of decode + eval transform in this process (no model)."""
    from triclip.data import PairDataset
    from triclip.model.towers import efficientnet_lite0_transform

    dataset = PairDataset(pairs, efficientnet_lite0_transform(train=False), train=False)
    n = min(count, len(dataset))
    start = time.perf_counter()
    for i in range(n):
        dataset[i]
    return n / (time.perf_counter() - start)


PIPELINES = {  # name -> embed_records' (workers, threads)
    "threads each decoding a batch for a one-thread tower (the default)": (0, None),
    "one thread decoding ahead of a two-thread tower (threads=1)": (0, 1),
    "one DataLoader worker process (workers=1)": (1, None),
}


def bench_pipelines(pairs, count: int, batch: int, rounds: int) -> dict[str, float]:
    """Best images/s of each of PIPELINES over ``rounds`` alternating rounds."""
    best = dict.fromkeys(PIPELINES, 0.0)
    for _ in range(rounds):
        for name, (workers, threads) in PIPELINES.items():
            best[name] = max(best[name], bench_pipeline(pairs, count, batch, workers, threads))
    return best


def bench_pipeline(pairs, count: int, batch: int, workers: int, threads: int | None = None) -> float:
    """Images/s of ``triclip.model.embed.embed_records`` (the default fast path) over the first ``count`` records."""
    from triclip.data import PairSet
    from triclip.model.embed import embed_records
    from triclip.model.model import ModelConfig, build_model

    global _LITE
    if _LITE is None:
        _LITE = build_model(ModelConfig(preset="lite")).eval()
    subset = PairSet(pairs.records[:count], source=pairs.source, max_pixels=pairs.max_pixels)
    embed_records(_LITE, PairSet(subset.records[:batch], source=pairs.source), "cpu", batch, workers, threads)  # warm-up
    start = time.perf_counter()
    emb, _, _ = embed_records(_LITE, subset, "cpu", batch, workers, threads)
    return len(emb) / (time.perf_counter() - start)


_LITE = None  # the lite model of bench_pipeline, built once


def _print_table(title: str, unit: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    print(f"{'method':<20} {unit:>9} {'ratio':>7} {'min cos':>10} {'prepare s':>10}")
    for row in rows:
        print(f"{row['method']:<20} {row['per_s']:9.1f} {row['ratio']:6.2f}x {row['min_cos']:10.6f} {row['prepare_s']:10.1f}")
    print(flush=True)


def _pairs(path: str):
    if not path or not os.path.exists(path):
        print(f"{path}: not found, timing on noise and synthetic captions")
        return None
    from triclip.data import load_pairs

    return load_pairs(path)


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


if __name__ == "__main__":
    main()
