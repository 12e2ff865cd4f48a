"""A new process's first image-tower pass: images per ONNX Runtime call against time, faults and peak memory.

Usage::

    .venv/bin/python -m benchmarks.bench_first_pass                      # the demo's train split, 16 then 4, twice
    .venv/bin/python -m benchmarks.bench_first_pass --calls 16,8,4 --rounds 3 --limit 1600

Each run is a new process with an empty ``TRICLIP_CACHE`` that builds the ``lite`` model and runs
``triclip.model.cache.image_tower_outputs`` (the demo's locked-tower pass: batches of ``accel.IMAGE_BATCH``,
two threads each calling a single-threaded session) with ``accel.SESSION_IMAGES`` set to one value of
``--calls``; the values alternate round by round. It prints the pass's wall time, its system time, minor page
faults, the process's peak resident memory, and whether the features equal the first value's bit for bit. On
a VM whose host backs a page anew each time a process first touches it, system time follows the faults.
"""

from __future__ import annotations

import argparse
import os
import resource
import time

from benchmarks.alternate import alternate, peak_gb

DEFAULT_DATA = "demo/data/train.jsonl"


def child(calls: int, data: str, limit: int | None, out: str) -> None:
    """One pass in this process; prints the RESULT line the parent reads."""
    from triclip.core.memory import keep_freed_memory

    keep_freed_memory()  # as every triclip command does
    import torch

    from triclip.data import load_pairs
    from triclip.model import accel
    from triclip.model.cache import image_tower_outputs
    from triclip.model.model import ModelConfig, build_model

    accel.SESSION_IMAGES = calls
    model = build_model(ModelConfig(preset="lite", embed_dim=256, head="mlp"))
    pairs = load_pairs(data)
    if limit:
        pairs.records = pairs.records[:limit]
    before, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    features = image_tower_outputs(model, pairs, torch.device("cpu"))["features"]
    after = resource.getrusage(resource.RUSAGE_SELF)
    torch.save(features, out)
    print(f"RESULT {time.perf_counter() - started:.1f} {after.ru_stime - before.ru_stime:.1f} "
          f"{after.ru_minflt - before.ru_minflt} {peak_gb():.2f}", flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--data", default=DEFAULT_DATA, help="a prepared data set (jsonl)")
    parser.add_argument("--calls", default="16,4", help="values of accel.SESSION_IMAGES, alternated")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each value")
    parser.add_argument("--limit", type=int, help="the first N records only")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args.child, args.data, args.limit, args.out)
    values = [int(v) for v in args.calls.split(",")]
    print(f"{args.data}: load average {os.getloadavg()[0]:.2f}; calls | pass s | system s | faults | peak GB | same")
    child_args = ["--data", args.data] + (["--limit", str(args.limit)] if args.limit else [])
    for calls, (wall, system, faults, peak), same in alternate("benchmarks.bench_first_pass", values, args.rounds, child_args):
        print(f"{calls:5d} | {wall:>6} | {system:>8} | {int(faults) / 1e3:5.0f}k | {peak:>7} | {same}", flush=True)


if __name__ == "__main__":
    main()
