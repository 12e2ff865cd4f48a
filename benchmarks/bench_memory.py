"""Where an index build's memory goes: resident memory per stage, anonymous apart from file-backed.

    python -m benchmarks.bench_memory build EMB --out INDEX [--every 0.1] [--tracemalloc] [--option VALUE ...]
        ``triclip index build --embeddings EMB --out INDEX ...`` in this process, with a thread that reads
        ``/proc/self/status`` every ``--every`` seconds. The build's stages are wrapped (open the shards, add
        each kind's shards, tune nprobe, write the vectors files, the evaluation set, choose the codes, fill
        them, write the version); for each stage it prints the peak of ``RssAnon`` (anonymous memory: what
        counts against the machine), ``RssFile`` at that moment (pages of memory-mapped files, which the
        kernel can take back), the peak ``VmRSS``, and ``RssAnon`` when the stage ended. ``--tracemalloc``
        adds the peak of memory allocated by Python objects per stage (slower: use a small collection).

    python -m benchmarks.bench_memory meta EMB --how list|stream
        The shards' meta rows as the build had them (``--how list``: every row in one list, then ``unique_ids``)
        or as it has them now (``stream``: ``triclip.index.metarows.MetaRows``, its unique ids found, every row
        read once in order): seconds, and the peak ``RssAnon`` above what the process held before. Run each in
        its own process.

    python -m benchmarks.bench_memory reader INDEX --queries Q.npy --how list|lazy [--k 10]
        A reader of the live version of INDEX: ``load_contents`` and the id -> row map a ``Searcher`` holds, then
        the (Q, D) query vectors of ``Q.npy`` (the first 100) searched at D, and each query's best hit looked up
        by its id (``search_ids``): the peak ``RssAnon`` above what the process held before, ``RssAnon`` at the
        end, ``VmHWM`` and the seconds of each part. ``--how lazy`` reads the version as it is (meta rows read
        when asked, ids found by hash: ``triclip.index.metafile``); ``--how list`` reads a copy of it made of hard
        links without the offset and id files (the manifest rewritten without them), as a version written before
        them is read: every row in one list and a dict of the ids. The model is not loaded (the queries are
        vectors). Run each in its own process.

    python -m benchmarks.bench_memory fill EMB [--kind text] [--shards 2] [--m 256] [--chunk 16384]
        A PQ16x8 code at m (fitted on 20,000 rows) filled with the first shards of ``kind`` as the build filled it
        before (a shard at once) and as it does now (``--chunk`` rows at once,
        ``triclip.index.vectors.ShardVectors.chunked``): the peak ``RssAnon`` above the start of each fill, its
        seconds, and whether the two codes are the same bytes.

Options after the positional arguments go to ``triclip index build`` as they are. Prints one JSON line: the
stages in the order they started (a nested stage, e.g. ``choose`` inside ``codes``, is its own line; a stage run
twice is ``name#2``; ``outside the stages``: imports, the moments between stages and after the last), and
``VmHWM`` (the peak resident memory the kernel recorded, what ``/usr/bin/time -v`` reports).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path

import numpy as np

MIB = 1024 * 1024
FIELDS = ("VmRSS", "RssAnon", "RssFile", "VmHWM")


def status() -> dict[str, int]:
    """The memory lines of ``/proc/self/status``, in bytes."""
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in FIELDS:
                out[key] = int(value.split()[0]) * 1024
    return out


class Stages:
    """The stage now running (innermost) and the peaks seen in each; a thread samples ``/proc/self/status``."""

    def __init__(self, every: float, traced: bool):
        self.every, self.traced = every, traced
        self.stack: list[str] = ["outside the stages"]  # imports, between stages, after the last
        self.peaks: dict[str, dict] = {}
        self.lock = threading.Lock()
        self.stopped = threading.Event()

    def sample(self) -> None:
        s = status()
        with self.lock:
            name = self.stack[-1]
            p = self.peaks.setdefault(name, {"anon_peak": 0, "file_at_anon_peak": 0, "rss_peak": 0})
            if s["RssAnon"] > p["anon_peak"]:
                p["anon_peak"], p["file_at_anon_peak"] = s["RssAnon"], s["RssFile"]
            p["rss_peak"] = max(p["rss_peak"], s["VmRSS"])

    def run(self) -> None:
        while not self.stopped.wait(self.every):
            self.sample()

    @contextlib.contextmanager
    def stage(self, name: str):
        self.sample()
        with self.lock:
            name = name if name not in self.peaks else f"{name}#{sum(k.startswith(name) for k in self.peaks) + 1}"
            self.stack.append(name)
            self.peaks[name] = {"anon_peak": 0, "file_at_anon_peak": 0, "rss_peak": 0}
        if self.traced:
            tracemalloc.reset_peak()
        started = time.perf_counter()
        try:
            yield
        finally:
            self.sample()
            with self.lock:
                p = self.peaks[name]
                p["anon_end"], p["seconds"] = status()["RssAnon"], round(time.perf_counter() - started, 1)
                if self.traced:
                    p["python_peak"] = tracemalloc.get_traced_memory()[1]
                self.stack.pop()

    def wrap(self, owner, attr: str, name) -> None:
        """Replace ``owner.attr`` by itself inside a stage (``name(*args)``: the stage's name, or a string)."""
        original = getattr(owner, attr)

        @functools.wraps(original)
        def wrapped(*args, **kwargs):
            with self.stage(name(*args, **kwargs) if callable(name) else name):
                return original(*args, **kwargs)

        setattr(owner, attr, wrapped)


def instrument(stages: Stages) -> None:
    """Wrap the build's stages (module attributes looked up at call time)."""
    from triclip.index import budgets, build, sources

    stages.wrap(sources, "open_embeddings", "open shards")
    stages.wrap(build.ShardedBuilder, "build_all", lambda self, vectors, factories, kind: f"index {kind}")
    stages.wrap(build, "tune_nprobe", "tune nprobe")
    stages.wrap(build, "_contents", "vectors files")
    stages.wrap(build, "_codes", "codes")
    stages.wrap(budgets, "indexed_evaluation", "evaluation set")
    stages.wrap(budgets, "choose_all", "choose codes")
    stages.wrap(build, "fill_codes", "fill codes")
    stages.wrap(build, "write_version", "write version")


def measure(emb: str, out: str, options: list[str], every: float, traced: bool) -> dict:
    from triclip.app.cli import main as triclip

    stages = Stages(every, traced)
    instrument(stages)
    if traced:
        tracemalloc.start()
    sampler = threading.Thread(target=stages.run, daemon=True)
    sampler.start()
    started = time.perf_counter()
    code = triclip(["index", "build", "--embeddings", emb, "--out", out, *options])
    stages.stopped.set()
    sampler.join()
    final = status()
    table = {name: {k: (round(v / MIB, 1) if k not in ("seconds",) else v) for k, v in p.items()}
             for name, p in stages.peaks.items()}
    return {"exit": code, "seconds": round(time.perf_counter() - started, 1), "vm_hwm_mib": round(final["VmHWM"] / MIB, 1),
            "anon_peak_mib": max(p["anon_peak"] for p in table.values()), "stages_mib": table}


def meta(emb: str, how: str) -> dict:
    """Peak anonymous memory and seconds of the meta rows held as a list or streamed (see the module's doc)."""
    from triclip.index.manifest import unique_ids
    from triclip.index.metarows import MetaRows, shard_meta_files
    from triclip.model.shards import check_complete, load_shard

    manifest = check_complete(emb)
    with sampled(how, 0.05) as took:
        if how == "list":
            rows = unique_ids([r for s in range(manifest["num_shards"]) for r in load_shard(emb, s, text=False)["meta"]])
            n, renamed = len(rows), sum("#" in r["id"] for r in rows)
        else:
            counts = [int(load_shard(emb, s, text=False, meta=False)["info"]["count"]) for s in range(manifest["num_shards"])]
            rows = MetaRows(shard_meta_files(emb, manifest["num_shards"]), counts)
            n, renamed = sum(1 for _ in rows), len(rows.renames)
    return {"how": how, "rows": n, "renamed": renamed, "seconds": took["seconds"],
            "anon_before_mib": round(took["anon_before"] / MIB, 1), "anon_peak_above_mib": took["anon_peak_above_mib"]}


@contextlib.contextmanager
def sampled(name: str, every: float):
    """Sample ``/proc/self/status`` every ``every`` s while the block runs as one stage; the dict yielded gets the
    anonymous memory before it, its peak above that (MiB) and the block's seconds."""
    stages = Stages(every, False)
    sampler = threading.Thread(target=stages.run, daemon=True)
    took = {"anon_before": status()["RssAnon"]}
    sampler.start()
    started = time.perf_counter()
    try:
        with stages.stage(name):
            yield took
    finally:
        stages.stopped.set()
        sampler.join()
    took["anon_peak_above_mib"] = round((stages.peaks[name]["anon_peak"] - took["anon_before"]) / MIB, 1)
    took["seconds"] = round(time.perf_counter() - started, 1)


def reader(index: str, queries: str, how: str, k: int) -> dict:
    """Memory and seconds of a reader opening a version and answering 100 queries (see the module's doc)."""
    from triclip.index import store
    from triclip.index.metafile import id_rows
    from triclip.index.search import Searcher

    q = np.load(queries)[:100].astype(np.float32)  # (Q, D)
    with contextlib.ExitStack() as stack:
        if how == "list":
            index = _without_meta_files(Path(index), Path(stack.enter_context(tempfile.TemporaryDirectory(dir=Path(index).parent))))
        start = status()
        with sampled("open", 0.05) as opened:
            contents = store.load_contents(index)
            searcher = Searcher(contents, None, None, None)
            searcher._rows = id_rows(contents.meta)  # as Searcher.load has it
        with sampled("queries", 0.05) as answered:
            hits = searcher.search_vectors(q, k)
            again = searcher.search_ids([h[0]["id"] for h in hits], k)
        end = status()
    same = sum(h[0]["id"] == a[0]["id"] for h, a in zip(hits, again))
    return {"how": how, "rows": len(contents.meta), "meta": type(contents.meta).__name__, "queries": len(q),
            "anon_before_mib": round(start["RssAnon"] / MIB, 1),
            "open": {"anon_peak_above_mib": opened["anon_peak_above_mib"], "seconds": opened["seconds"]},
            "queries_and_ids": {"anon_peak_above_mib": answered["anon_peak_above_mib"], "seconds": answered["seconds"]},
            "anon_end_above_mib": round((end["RssAnon"] - start["RssAnon"]) / MIB, 1),
            "vm_hwm_mib": round(end["VmHWM"] / MIB, 1), "ids_found_themselves": same}


def _without_meta_files(index: Path, tmp: Path) -> Path:
    """A copy in ``tmp`` of the live version of ``index``, made of hard links, without the offset and id files
    (its manifest, rewritten, records none): a version as written before them."""
    from triclip.index.filecheck import FILES as RECORDS
    from triclip.index.metafile import FILES
    from triclip.index.store import MANIFEST, current_version

    version = current_version(index)
    out = tmp / "index"
    (out / version).mkdir(parents=True)
    for name in (".triclip.json", "CURRENT"):
        shutil.copyfile(index / name, out / name)
    for file in (index / version).iterdir():
        if file.name not in FILES and file.name != MANIFEST:
            os.link(file, out / version / file.name)
    manifest = json.loads((index / version / MANIFEST).read_text())
    for name in FILES:
        manifest[RECORDS].pop(name, None)
    (out / version / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return out


def fill(emb: str, kind: str, shards: int, m: int, chunk: int) -> dict:
    """One code filled a shard at once and ``chunk`` rows at once: peak anonymous memory, seconds, same bytes."""
    from triclip import codecs
    from triclip.codecs.spec import CodecSpec
    from triclip.index import budgets
    from triclip.index import scale
    from triclip.index.vectors import ShardVectors

    vectors = ShardVectors.open(emb, shards, kind)
    rows = np.sort(np.random.default_rng(0).choice(vectors.count, size=min(20_000, vectors.count), replace=False))
    codec = codecs.fit(CodecSpec("pq", m, 16, {"M": 16, "nbits": 8}), vectors.rows(rows, vectors.dim))
    out, codes = {}, {}
    for how, source in (("whole shards", vectors), (f"{chunk} rows", vectors.chunked(chunk))):
        with sampled(how, 0.02) as took:
            full = scale.fill(codec, source)
        out[how] = {"anon_peak_above_mib": took["anon_peak_above_mib"], "seconds": took["seconds"]}
        path = Path(tempfile.mkdtemp()) / "codes"
        full.save(path)
        codes[how] = path.read_bytes()
        shutil.rmtree(path.parent)
    return {"kind": kind, "rows": vectors.count, "code": f"PQ16x8 at m={m}", "fills": out,
            "same_bytes": len(set(codes.values())) == 1}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_memory", description=__doc__.split("\n")[0],
                                     allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", allow_abbrev=False)
    b.add_argument("emb")
    b.add_argument("--out", required=True)
    b.add_argument("--every", type=float, default=0.1)  # seconds between two reads of /proc/self/status
    b.add_argument("--tracemalloc", action="store_true")  # also Python's allocations per stage (slower)
    m = sub.add_parser("meta", allow_abbrev=False)
    m.add_argument("emb")
    m.add_argument("--how", choices=("list", "stream"), required=True)
    r = sub.add_parser("reader", allow_abbrev=False)
    r.add_argument("index")
    r.add_argument("--queries", required=True)  # (Q, D) float query vectors, .npy
    r.add_argument("--how", choices=("list", "lazy"), required=True)
    r.add_argument("--k", type=int, default=10)
    f = sub.add_parser("fill", allow_abbrev=False)
    f.add_argument("emb")
    f.add_argument("--kind", choices=("image", "text"), default="text")
    f.add_argument("--shards", type=int, default=2)
    f.add_argument("--m", type=int, default=256)
    f.add_argument("--chunk", type=int, default=16384)
    args, options = parser.parse_known_args(argv)
    if args.command == "fill":
        if options:
            parser.error(f"unrecognized arguments: {' '.join(options)}")
        result = fill(args.emb, args.kind, args.shards, args.m, args.chunk)
    elif args.command == "reader":
        if options:
            parser.error(f"unrecognized arguments: {' '.join(options)}")
        result = reader(args.index, args.queries, args.how, args.k)
    elif args.command == "meta":
        if options:
            parser.error(f"unrecognized arguments: {' '.join(options)}")
        result = meta(args.emb, args.how)
    else:
        result = measure(args.emb, args.out, options, args.every, args.tracemalloc)
    print(json.dumps({"command": args.command, **result}), flush=True)


if __name__ == "__main__":
    main()
