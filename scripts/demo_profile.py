"""Where the demo's time goes: a py-spy profile of ``triclip demo`` summed by demo step and by innermost triclip function.

Usage::

    TRICLIP_CACHE=$(mktemp -d) py-spy record -r 25 -s -f raw -o demo.txt -- .venv/bin/python -m triclip demo --workdir NEW --no-serve
    .venv/bin/python scripts/demo_profile.py demo.txt [--rate 25] [--top 25]

Seconds are samples / rate, per thread and process (``-s``: the thumbnail workers too), so they add up to more than
the wall time where two threads or processes ran at once. Sampling slows the demo (384 s sampled against 283 s).
"""

from __future__ import annotations

import argparse
import re
from collections import Counter

STEPS = {"prepare (": "1 data", "_train (": "2 train (MRL, tricl)", "_solve (": "2 solve (Eq. 6)",  # frame -> step
         "_evaluate (": "3 test evaluation", "_index (": "4 index", "_add_splits (": "4 index"}


def summarise(lines) -> tuple[Counter, Counter]:
    """(samples per demo step, samples per (step, innermost triclip function)) of py-spy's raw lines."""
    steps, functions = Counter(), Counter()
    for line in lines:
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        step = next((name for key, name in STEPS.items() for f in frames if f.startswith(key)), "other (worker threads, start-up)")
        inner = [f for f in frames if "triclip/" in f]
        where = re.sub(r" \(.*?(triclip/[^:]+):\d+\)", r" (\1)", inner[-1] if inner else frames[-1])
        steps[step] += int(count)
        functions[(step, where)] += int(count)
    return steps, functions


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("profile", help="py-spy record -f raw output")
    parser.add_argument("--rate", type=float, default=25.0, help="py-spy's samples per second (-r)")
    parser.add_argument("--top", type=int, default=25, help="functions listed")
    args = parser.parse_args(argv)
    with open(args.profile) as f:
        steps, functions = summarise(f)
    print("seconds  demo step")
    for step, n in sorted(steps.items()):
        print(f"{n / args.rate:7.1f}  {step}")
    print("\nseconds  demo step / innermost triclip function")
    for (step, where), n in functions.most_common(args.top):
        print(f"{n / args.rate:7.1f}  {step} / {where[:110]}")


if __name__ == "__main__":
    main()
