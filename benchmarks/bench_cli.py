"""Where the time of one ``triclip search --text`` goes: the torch path against the ONNX text path.

Usage::

    .venv/bin/python -m benchmarks.bench_cli --index INDEX                 # 5 rounds, "a red circle"
    .venv/bin/python -m benchmarks.bench_cli --index INDEX --text "..." --rounds 9 --json out.json

Every measurement is a fresh process (as a user's command), with the disk cache warm
and the text export cached (one warm-up run of each first). Per round, alternating so
a load change on a shared machine hits both alike:

- ``torch``: what ``triclip search --text`` did before the export: import the index and
  torch modules, ``Searcher.load(INDEX)`` (the whole run: both towers), embed, search.
- ``onnx``: ``Searcher.load(INDEX, text_only=True)``: the cached ONNX text side with
  ``tokenizers`` + ONNX Runtime; torch is never imported.
- ``cli``: the command itself, ``triclip search --index INDEX --text ...`` (the onnx path).

Phases: ``startup`` (interpreter start until the driver runs), ``imports``, ``load``
(index + model or text encoder), ``embed`` (one query), ``search`` (FAISS), ``exit``
(interpreter shutdown: wall minus the rest), ``wall`` (the whole process, measured by
this script), ``cpu`` (user + system CPU seconds of the process: on a shared machine
the wall clock grows with the load, this much less). Each is the median over rounds;
the ratio is torch / onnx.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("startup", "imports", "load", "embed", "search", "exit", "wall", "cpu")

DRIVER = r"""
import json, os, sys, time
t0 = time.perf_counter()
with open("/proc/self/stat") as fh:
    ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
with open("/proc/uptime") as fh:
    startup = max(0.0, float(fh.read().split()[0]) - ticks / os.sysconf("SC_CLK_TCK"))
index, text, path = sys.argv[1], sys.argv[2], sys.argv[3]
from triclip.index.search import Searcher
if path == "torch":  # what triclip.index.search imported before the ONNX path
    import torch, triclip.compact.features, triclip.model.embed, triclip.model.run  # noqa: F401
t1 = time.perf_counter()
searcher = Searcher.load(index, text_only=path == "onnx")
t2 = time.perf_counter()
queries = searcher.embed_texts([text])
t3 = time.perf_counter()
hits = searcher.search_vectors(queries, k=10)
t4 = time.perf_counter()
print(json.dumps({"startup": startup, "imports": t1 - t0, "load": t2 - t1, "embed": t3 - t2, "search": t4 - t3,
                  "encoder": "onnx" if searcher.text_encoder is not None else "torch",
                  "torch_imported": "torch" in sys.modules, "top": [h["id"] for h in hits[0]]}))
"""


def run_driver(index: str, text: str, path: str) -> dict:
    """One fresh process through ``path`` ("torch" or "onnx"); its phases and wall seconds."""
    start, cpu = time.perf_counter(), _children_cpu()
    done = subprocess.run([sys.executable, "-c", DRIVER, index, text, path], cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{path} driver failed:\n{done.stderr[-2000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    out["wall"], out["cpu"] = wall, _children_cpu() - cpu
    out["exit"] = wall - sum(out[p] for p in ("startup", "imports", "load", "embed", "search"))
    return out


def run_cli(index: str, text: str) -> dict:
    """``triclip search --index I --text T --timing`` in a fresh process: its own timing line and the wall."""
    start, cpu = time.perf_counter(), _children_cpu()
    cmd = [sys.executable, "-m", "triclip", "search", "--index", index, "--text", text, "--timing"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"triclip search failed:\n{done.stderr[-2000:]}")
    timing = json.loads(done.stderr.split("timing: ", 1)[1].splitlines()[0])
    phases = {
        "startup": timing["startup_s"],
        "imports": timing["import_s"],
        "load": timing["index_load_s"] + timing["model_load_s"],
        "embed": timing["embed_s"],
        "search": timing["search_s"],
        "wall": wall,
        "cpu": _children_cpu() - cpu,
        "encoder": timing.get("text_encoder", "torch"),
    }
    phases["exit"] = wall - sum(phases[p] for p in ("startup", "imports", "load", "embed", "search"))
    return phases


def _children_cpu() -> float:
    """User + system CPU seconds of the finished child processes so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--index", required=True, help="an index folder built from a lite run")
    parser.add_argument("--text", default="a red circle", help="the query")
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds (each: torch, onnx, cli)")
    parser.add_argument("--json", default=None, help="also write every round here")
    args = parser.parse_args(argv)
    index = str(Path(args.index).resolve())

    warm = run_driver(index, args.text, "onnx")  # writes the export if the cache has none
    if warm["encoder"] != "onnx":
        warm = run_driver(index, args.text, "onnx")
    if warm["encoder"] != "onnx":
        raise SystemExit("the onnx path is not taken for this index (not a lite run, or onnx / onnxruntime missing)")
    run_driver(index, args.text, "torch")
    rounds = {"torch": [], "onnx": [], "cli": []}
    for _ in range(args.rounds):
        rounds["torch"].append(run_driver(index, args.text, "torch"))
        rounds["onnx"].append(run_driver(index, args.text, "onnx"))
        rounds["cli"].append(run_cli(index, args.text))
    same = all(r["top"] == rounds["torch"][0]["top"] for r in rounds["onnx"])
    assert not any(r["torch_imported"] for r in rounds["onnx"]), "the onnx path imported torch"

    load = os.getloadavg()
    print(f"index {index}; query {args.text!r}; {args.rounds} rounds, medians in seconds; "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, {os.cpu_count()} cores, "
          f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")  # fmt: skip
    print(f"{'phase':<10}{'torch':>10}{'onnx':>10}{'ratio':>9}{'cli':>10}")
    for phase in PHASES:
        t, o, c = (statistics.median(r[phase] for r in rounds[k]) for k in ("torch", "onnx", "cli"))
        print(f"{phase:<10}{t:10.3f}{o:10.3f}{t / o if o > 0 else float('inf'):8.1f}x{c:10.3f}")
    print(f"same top-10 ids on both paths: {same}; torch imported on the onnx path: never")
    if args.json:
        Path(args.json).write_text(json.dumps({"index": index, "text": args.text, "rounds": rounds}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
