"""The one pass below the cut of a partly unlocked ``lite`` image tower: threads against time.

Usage::

    .venv/bin/python -m benchmarks.bench_bottom_pass                     # the demo's train split, 1 then 2, twice
    .venv/bin/python -m benchmarks.bench_bottom_pass --threads 1,2 --rounds 3 --limit 1600 --image-groups 2

Each run is a new process with an empty ``TRICLIP_CACHE`` that builds the ``lite`` model, unlocks its top
``--image-groups`` groups (``triclip.model.unlock.partly_lock``) and runs ``unlock.image_bottom_outputs`` (what
``train --unlock-image-groups G`` computes once before its epochs) with ``accel.module_pass_threads`` set to one
value of ``--threads``: 1 decodes the next batch in a background thread while a two-thread session runs, 2 runs
two threads each decoding a batch for a single-threaded session. The values alternate round by round. It prints
the pass's wall time, its CPU time, the process's peak resident memory, and whether the activations equal the
first value's bit for bit. A tree without ``module_pass_threads`` runs its own pass whatever is asked.
"""

from __future__ import annotations

import argparse
import os
import resource
import time

from benchmarks.alternate import alternate, peak_gb

DEFAULT_DATA = "demo/data/train.jsonl"


def child(threads: int, data: str, limit: int | None, groups: int, views: int, out: str) -> None:
    """One pass in this process; prints the RESULT line the parent reads."""
    from triclip.core.memory import keep_freed_memory

    keep_freed_memory()  # as every triclip command does
    import torch

    from triclip.data import load_pairs
    from triclip.model import accel, unlock
    from triclip.model.model import ModelConfig, build_model

    if hasattr(accel, "module_pass_threads"):  # older trees run one thread whatever is asked
        accel.module_pass_threads = lambda module, device: threads
    model = build_model(ModelConfig(preset="lite", embed_dim=256, head="mlp")).eval()
    unlock.partly_lock(model, image_groups=groups)
    pairs = load_pairs(data)
    if limit:
        pairs.records = pairs.records[:limit]
    before, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    x = unlock.image_bottom_outputs(model, pairs, torch.device("cpu"), views=views, budget_gb=20)["x"]
    after = resource.getrusage(resource.RUSAGE_SELF)
    torch.save(x, out)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    print(f"RESULT {time.perf_counter() - started:.1f} {cpu:.1f} {peak_gb():.2f}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--data", default=DEFAULT_DATA, help="a prepared data set (jsonl)")
    parser.add_argument("--threads", default="1,2", help="values of accel.module_pass_threads, alternated")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each value")
    parser.add_argument("--limit", type=int, help="the first N records only")
    parser.add_argument("--image-groups", type=int, default=1,
                        help="top groups of the image tower unlocked (train --unlock-image-groups)")
    parser.add_argument("--views", type=int, default=1, help="views per image (train --cached-views)")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args.child, args.data, args.limit, args.image_groups, args.views, args.out)
    values = [int(v) for v in args.threads.split(",")]
    print(f"{args.data}: load average {os.getloadavg()[0]:.2f}; threads | pass s | CPU s | peak GB | same")
    child_args = ["--data", args.data, "--image-groups", str(args.image_groups), "--views", str(args.views)]
    child_args += ["--limit", str(args.limit)] if args.limit else []
    for threads, (wall, cpu, peak), same in alternate("benchmarks.bench_bottom_pass", values, args.rounds, child_args):
        print(f"{threads:7d} | {wall:>6} | {cpu:>5} | {peak:>7} | {same}", flush=True)


if __name__ == "__main__":
    main()
