"""The demo's training half at one seed and one MRL epoch count: MRL, the solve, ``tricl``, the test recall.

Usage::

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.demo_recipe --data demo/data --out runs/demo_recipe \\
        --seed 0 --mrl-epochs 20

Runs ``triclip.app.demo``'s own steps (``_train`` with ``MRL_STEP``, ``_solve``, ``_train`` with ``TUNE_STEP``)
into ``OUT/mrlE_seedS`` and evaluates the served run on ``DATA/test.jsonl`` (full D and the S-ordered compact
curve at m = 16, 32, 64). Prints one JSON line (recall and seconds per step) and appends it to ``OUT/results.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="the demo's data folder (train / val / test .jsonl)")
    parser.add_argument("--out", required=True, help="runs go to OUT/mrlE_seedS")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mrl-epochs", type=int, required=True)
    args = parser.parse_args(argv)
    result = run(Path(args.data), Path(args.out), args.seed, args.mrl_epochs)
    print(json.dumps(result), flush=True)
    with open(Path(args.out) / "results.jsonl", "a") as out:
        out.write(json.dumps(result) + "\n")
    return result


def run(data: Path, out: Path, seed: int, mrl_epochs: int) -> dict:
    """Train, solve, tune and evaluate one seed (its folder made anew)."""
    from triclip.app import demo
    from triclip.app.config import DemoConfig
    from triclip.training.config import MRL_STEP, TUNE_STEP
    from triclip.training.evaluate import evaluate_run

    work = out / f"mrl{mrl_epochs}_seed{seed}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    cfg, times = DemoConfig(workdir=str(work), serve=False), {}
    steps = {
        "mrl": lambda: demo._train(cfg, data, work / "mrl", seed=seed, **{**MRL_STEP, "epochs": mrl_epochs}),
        "solve": lambda: demo._solve(data, work / "mrl", work / "solved"),
        "tricl": lambda: demo._train(cfg, data, work / "run", init=work / "solved", seed=seed, **TUNE_STEP),
        "test": lambda: evaluate_run(str(work / "run"), str(data / "test.jsonl"), dims=[16, 32, 64]),
    }
    for name, step in steps.items():
        start = time.perf_counter()
        metrics = step()
        times[name] = round(time.perf_counter() - start, 1)
    return {
        "seed": seed, "mrl_epochs": mrl_epochs, "seconds": times,
        **{k: float(metrics[k]) for k in ("t2i_r1", "t2i_r10", "i2t_r1", "i2t_r10")},
        "compact_importance": {str(m): float(v) for m, v in metrics["compact"]["importance"].items()},
    }


if __name__ == "__main__":
    main()
